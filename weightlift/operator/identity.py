"""Model identity: replicas with the same identity hold bit-identical weights per rank, so any of
them can feed another, across ModelDeployments of a namespace."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from weightlift.api.model import Engine, ModelDeploymentSpec

IDENTITY_LENGTH = 16
TEMPLATE_REVISION_LENGTH = 10


def model_identity(spec: ModelDeploymentSpec) -> str:
    """Hash of what determines the bytes on each rank: uri, revision, format, dtype, the rank
    layout (tensor, pipeline, pods per replica) and, for vLLM and Triton, the engine and its
    args."""
    material = {
        "uri": spec.model.uri.rstrip("/"),
        "revision": spec.model.revision,
        "format": str(spec.model.format),
        "dtype": spec.model.dtype,
        "tensor": spec.parallelism.tensor,
    }
    # Pipeline stages and pods per replica change which bytes each rank holds and where; they
    # join the material only when not 1, so every single-pod, single-stage identity stays as it was.
    if spec.parallelism.pipeline != 1:
        material["pipeline"] = spec.parallelism.pipeline
    if spec.parallelism.pods_per_replica != 1:
        material["podsPerReplica"] = spec.parallelism.pods_per_replica
    if spec.model.endpoint:  # the same bucket/repo name on another store is other bytes
        material["endpoint"] = spec.model.endpoint.rstrip("/")
    if spec.runtime.engine in (Engine.VLLM, Engine.TRITON):
        # vLLM replicas exchange vLLM's own per-rank parameters (worker/engines/vllm/weights.py),
        # which its engine args can change (--dtype, --quantization, ...): only replicas
        # started alike meet. Builtin identities stay as they were.
        material["engine"] = str(spec.runtime.engine)
        material["engineArgs"] = list(spec.runtime.engine_args)
    return _digest(material, IDENTITY_LENGTH)


def pod_template_revision(spec: ModelDeploymentSpec) -> str:
    """Hash of what a worker pod is made of and starts with: spec.template, spec.runtime and
    spec.initHooks. A change rolls the replicas onto new pods, as a Deployment's
    pod-template-hash does; under the same identity the new pods pull from the old ones.
    Loading, probe, Service and scale settings do not roll pods. Fields at their defaults are
    left out, so a field a newer version adds (at its default) rolls nothing."""
    parts = {"template": spec.template, "runtime": spec.runtime, "initHooks": spec.init_hooks}
    material = {
        key: part.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        if part is not None
        else None
        for key, part in parts.items()
    }
    return _digest(material, TEMPLATE_REVISION_LENGTH)


def _digest(material: dict[str, Any], length: int) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:length]
