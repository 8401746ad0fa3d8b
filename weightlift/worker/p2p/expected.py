"""What one rank's shard must contain: names, dtypes and shapes from the safetensors headers.

A target that has the model files (a shared volume) checks the source's manifest against their
headers, reading no tensor data. A target without the files trusts the manifest's layout and
verifies the bytes through the checksums.

Files and headers come from the shared safetensors floor (weights/files.py, weights/header.py), so a
file the loaders reject is rejected here with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.p2p.manifest import RankManifest
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.header import DTYPE_SIZES

_FLOAT_TYPES = {"F64", "F32", "F16", "BF16"}
_CAST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ExpectedTensor:
    dtype: str
    shape: tuple[int, ...]


class ShapeMismatch(ValueError):
    """The source's manifest does not describe what this model's rank needs."""


def _has_safetensors(model_dir: Path) -> bool:
    return model_dir.is_dir() and any(model_dir.glob("*.safetensors"))


def expected_for_rank(
    model_dir: str | Path, rank: int, tensor_parallel: int, cast_dtype: str = "auto"
) -> dict[str, ExpectedTensor] | None:
    """What rank `rank` needs, or None when this host has no files to tell (trust-but-verify)."""
    d = Path(model_dir)
    if not _has_safetensors(d):
        return None
    out: dict[str, ExpectedTensor] = {}
    for name, (_, info) in shard_index(d, rank, tensor_parallel).tensors.items():
        dtype = info.dtype
        if cast_dtype in _CAST and dtype in _FLOAT_TYPES:
            dtype = _CAST[cast_dtype]
        out[name] = ExpectedTensor(dtype=dtype, shape=info.shape)
    return out


def check_manifest(
    manifest: RankManifest,
    *,
    identity: str,
    rank: int,
    expected: dict[str, ExpectedTensor] | None,
    peer: str,
    layout: str = "",
) -> None:
    """Raise ShapeMismatch naming the peer and tensor when the manifest is not what we need."""
    if manifest.identity != identity:
        raise ShapeMismatch(
            f"peer {peer}: model identity {manifest.identity!r} != ours {identity!r}"
        )
    if manifest.layout != layout:
        theirs, ours = manifest.layout or "the checkpoint's", layout or "the checkpoint's"
        raise ShapeMismatch(f"peer {peer}: its tensors are laid out by {theirs}, ours by {ours}")
    if manifest.rank != rank:
        raise ShapeMismatch(f"peer {peer}: manifest is for rank {manifest.rank}, we need {rank}")
    for t in manifest.tensors:
        if t.dtype not in DTYPE_SIZES:
            raise ShapeMismatch(f"peer {peer}: tensor {t.name!r} has unknown dtype {t.dtype}")
    if expected is None:
        return
    have = {t.name: t for t in manifest.tensors}
    missing = sorted(set(expected) - set(have))
    extra = sorted(set(have) - set(expected))
    if missing:
        raise ShapeMismatch(
            f"peer {peer}: rank {rank} manifest lacks {len(missing)} tensor(s), e.g. {missing[0]!r}"
        )
    if extra:
        raise ShapeMismatch(
            f"peer {peer}: rank {rank} manifest has {len(extra)} unexpected tensor(s), "
            f"e.g. {extra[0]!r}"
        )
    for name, want in expected.items():
        got = have[name]
        if got.dtype != want.dtype:
            raise ShapeMismatch(
                f"peer {peer}: tensor {name!r} dtype {got.dtype} != expected {want.dtype}"
            )
        if tuple(got.shape) != want.shape:
            raise ShapeMismatch(
                f"peer {peer}: tensor {name!r} shape {list(got.shape)} != expected "
                f"{list(want.shape)}"
            )
