"""Storage test helpers: MinIO on loopback (`make minio`), small safetensors models, plans."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightlift.api.model import LoadingSpec, ModelSource
from weightlift.api.worker import WorkerPlan
from weightlift.local.s3server import MinioServer, S3ServerError, minio_path


def require_minio() -> None:
    try:
        minio_path()
    except S3ServerError as exc:
        if os.environ.get("WEIGHTLIFT_REQUIRE_CLUSTER"):
            pytest.fail(f"{exc} [WEIGHTLIFT_REQUIRE_CLUSTER is set]", pytrace=False)
        pytest.skip(str(exc))


def minio(tmp: Path) -> Iterator[MinioServer]:
    require_minio()
    with MinioServer(tmp / "minio") as server:
        yield server


def make_model(out: Path, *, files: int = 2, mb: float = 2.0, seed: int = 0) -> dict[str, bytes]:
    """model-0000k-of-N.safetensors + model.json; returns name -> bytes of every file."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = int(mb * (1 << 20)) // 4 // 4
    for k in range(1, files + 1):
        tensors = {f"layer{k}.w{j}": rng.standard_normal(n, dtype=np.float32) for j in range(4)}
        save_file(tensors, str(out / f"model-{k:05d}-of-{files:05d}.safetensors"))
    (out / "model.json").write_text(json.dumps({"layers": files}))
    return {p.name: p.read_bytes() for p in out.iterdir()}


def plan_for(
    uri: str,
    model_dir: Path,
    *,
    endpoint: str | None = None,
    cache: Path | None = None,
    identity: str = "0123456789abcdef",
    revision: str = "main",
    max_size_gib: int = 100,
) -> WorkerPlan:
    loading = LoadingSpec.model_validate(
        {"cache": {"enabled": True, "path": str(cache), "maxSizeGiB": max_size_gib}}
        if cache
        else {}
    )
    return WorkerPlan(
        deployment="d",
        pod_name="d-0",
        model_identity=identity,
        model=ModelSource(uri=uri, endpoint=endpoint, revision=revision),
        model_dir=str(model_dir),
        served_model_name="m",
        loading=loading,
    )
