"""Helpers for tests and the bench: a presharded safetensors model and worker plans for it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from weightlift.api.model import (
    ChecksumSetting,
    LoadingSpec,
    ModelSource,
    PeerToPeerOptions,
    Role,
)
from weightlift.api.worker import PeerCandidate, WorkerPlan


def write_sharded_model(
    out: Path,
    *,
    size_mb: float,
    tensor_parallel: int = 2,
    layers: int = 4,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[int, list[Path]]:
    """rank-{r}-of-{tp}.safetensors files of about `size_mb` MB in total (all ranks), random
    data, the layout the worker's loaders read. Returns rank -> files."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    per_rank = int(size_mb * 1e6) // tensor_parallel
    # Per layer: a [h, h] weight, a [h] bias and a [4h, h] up-projection → 5h² + h elements.
    per_layer = per_rank // layers // elem
    hidden = max(8, int((per_layer / 5) ** 0.5) // 8 * 8)
    files: dict[int, list[Path]] = {}
    for r in range(tensor_parallel):
        tensors: dict[str, torch.Tensor] = {}
        for i in range(layers):
            for name, shape in (
                (f"layers.{i}.attn.weight", (hidden, hidden)),
                (f"layers.{i}.attn.bias", (hidden,)),
                (f"layers.{i}.mlp.up.weight", (4 * hidden, hidden)),
            ):
                tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        tensors["embed.scale"] = torch.tensor([r + 1], dtype=torch.int64)
        path = out / f"rank-{r}-of-{tensor_parallel}.safetensors"
        save_file(tensors, str(path))
        files[r] = [path]
    return files


def make_plan(
    model_dir: Path,
    *,
    pod: str,
    identity: str = "ident-test",
    tensor_parallel: int = 2,
    ranks: list[int] | None = None,
    role: Role = Role.SOURCE,
    peers: list[PeerCandidate] | None = None,
    transfer_timeout_seconds: int = 10,
    max_in_flight: int = 8,
    checksum: ChecksumSetting = "auto",
) -> WorkerPlan:
    return WorkerPlan(
        deployment="demo",
        pod_name=pod,
        model_identity=identity,
        model=ModelSource(uri=f"file://{model_dir}"),
        model_dir=str(model_dir),
        served_model_name="demo",
        tensor_parallel=tensor_parallel,
        ranks=list(range(tensor_parallel)) if ranks is None else ranks,
        device="cpu",
        role=role,
        peers=peers or [],
        loading=LoadingSpec(
            peer_to_peer=PeerToPeerOptions(
                transfer_timeout_seconds=transfer_timeout_seconds,
                max_in_flight=max_in_flight,
                checksum=checksum,
            )
        ),
    )
