"""The compile-cache stores a vLLM replica uses, from the operator's env: the node's, then the
cluster's (a pvc:// claim's directory, or S3)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from weightlift.api.worker import COMPILE_STORE_SHARED_ENV, COMPILE_STORE_URI_ENV
from weightlift.worker.engines.vllm.compile_store import (
    CompileStore,
    NodeStore,
    bound_from,
    node_store,
)

log = logging.getLogger(__name__)


def open_stores(environ: Mapping[str, str] | None = None) -> list[CompileStore]:
    """The stores a replica reads before its engine compiles and writes once Ready, nearest
    first: the node's, then the cluster's (COMPILE_STORE_URI_ENV)."""
    env = os.environ if environ is None else environ
    stores: list[CompileStore] = []
    node = node_store(env)
    if node is not None:
        stores.append(node)
    shared = env.get(COMPILE_STORE_SHARED_ENV, "").strip()
    if shared:  # a ReadWriteMany claim: the same directory store, on every node
        stores.append(NodeStore(Path(shared), bound_from(env), label="the cluster store"))
    uri = env.get(COMPILE_STORE_URI_ENV, "").strip()
    if uri.startswith("s3://"):
        from weightlift.worker.engines.vllm.compile_store_s3 import s3_store  # boto3: lazily

        stores.append(s3_store(uri, bound_from(env), env))
    elif uri:
        log.warning("compile store %s: only s3:// is supported; none used", uri)
    return stores
