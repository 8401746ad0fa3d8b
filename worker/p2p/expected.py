"""What one rank's shard must contain: names, dtypes and shapes from the safetensors headers.

A target that has the model files (a shared volume) checks the source's manifest against their
headers, reading no tensor data. A target without the files trusts the manifest's layout and
verifies the bytes through the checksums.

The shard layout is the worker loaders' (weightlift.worker.loaders.files): model.safetensors or
model-0000k-of-N.safetensors for tp == 1, rank-{r}-of-{tp}[-NNNNN].safetensors for tp > 1.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from weightlift.worker.p2p.manifest import DTYPES, RankManifest

_MAX_HEADER = 100 << 20
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


def _headers_via_loaders(model_dir: Path, rank: int, tp: int) -> dict[str, ExpectedTensor]:
    from weightlift.worker.loaders.files import shard_index

    index = shard_index(model_dir, rank, tp)
    return {
        name: ExpectedTensor(dtype=info.dtype, shape=tuple(info.shape))
        for name, (_, info) in index.tensors.items()
    }


def read_header(path: Path) -> dict[str, ExpectedTensor]:
    """Names, dtypes and shapes from one safetensors file's JSON header (no tensor data read)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is implausible")
        text = f.read(n)
    if len(text) != n:
        raise ValueError(f"{path}: truncated header")
    try:
        header = json.loads(text)
        return {
            name: ExpectedTensor(dtype=str(info["dtype"]), shape=tuple(info["shape"]))
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: bad header: {exc}") from None


def _headers_own(model_dir: Path, rank: int, tp: int) -> dict[str, ExpectedTensor]:
    names = sorted(model_dir.glob("*.safetensors"))
    ranked = [p for p in names if re.match(rf"^rank-{rank}-of-{tp}(-\d+)?\.safetensors$", p.name)]
    files = ranked or ([p for p in names if p.name.startswith("model")] if tp == 1 else [])
    if not files:
        raise ValueError(f"model dir {model_dir}: no safetensors files for rank {rank} of {tp}")
    out: dict[str, ExpectedTensor] = {}
    for f in files:
        for name, t in read_header(f).items():
            if name in out:
                raise ValueError(f"{f}: tensor {name!r} also appears in another shard file")
            out[name] = t
    return out


def expected_for_rank(
    model_dir: str | Path, rank: int, tensor_parallel: int, cast_dtype: str = "auto"
) -> dict[str, ExpectedTensor] | None:
    """What rank `rank` needs, or None when this host has no files to tell (trust-but-verify)."""
    d = Path(model_dir)
    if not _has_safetensors(d):
        return None
    try:
        headers = _headers_via_loaders(d, rank, tensor_parallel)
    except ImportError:
        headers = _headers_own(d, rank, tensor_parallel)
    out: dict[str, ExpectedTensor] = {}
    for name, t in headers.items():
        dtype = t.dtype
        if cast_dtype in _CAST and dtype in _FLOAT_TYPES:
            dtype = _CAST[cast_dtype]
        out[name] = ExpectedTensor(dtype=dtype, shape=t.shape)
    return out


def check_manifest(
    manifest: RankManifest,
    *,
    identity: str,
    rank: int,
    expected: dict[str, ExpectedTensor] | None,
    peer: str,
) -> None:
    """Raise ShapeMismatch naming the peer and tensor when the manifest is not what we need."""
    if manifest.identity != identity:
        raise ShapeMismatch(
            f"peer {peer}: model identity {manifest.identity!r} != ours {identity!r}"
        )
    if manifest.rank != rank:
        raise ShapeMismatch(f"peer {peer}: manifest is for rank {manifest.rank}, we need {rank}")
    for t in manifest.tensors:
        if t.dtype not in DTYPES:
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
