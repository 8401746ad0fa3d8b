"""The per-rank manifest a source publishes, and the checksums both sides compute.

A manifest describes one rank's shard as the source holds it in NIXL-registered memory: a few
large regions (address, length) and, per tensor, its name, dtype, shape, byte size, the region and
offset it lives at, and a checksum of its bytes. The target reads the bytes with one-sided READs
and recomputes every checksum before it hands the tensors to the runtime. Dtypes travel as
safetensors names (weights/header.py's table).

Checksum kinds: xxh3 and crc32 hash on the host (CUDA bytes are staged through pinned memory);
dev64 (`devsum.py`) is computed on the device that holds the bytes, with a CPU implementation
that gives the same digest, so a GPU source's manifest verifies on a CPU target and back. The
manifest names its kind; the plan's `auto` resolves by the device of the weights published.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterable
from typing import Literal, get_args

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

from weightlift.api.model import ChecksumSetting
from weightlift.worker.p2p.devsum import dev64, hexdigest
from weightlift.worker.weights.header import DTYPE_SIZES

MANIFEST_VERSION = 1
ChecksumKind = Literal["xxh3", "crc32", "dev64"]
CHECKSUM_KINDS: tuple[ChecksumKind, ...] = get_args(ChecksumKind)

# Hashing in slices keeps a device-to-host staging buffer small and lets other threads run.
_HASH_SLICE = 64 << 20


def element_size(name: str) -> int:
    return DTYPE_SIZES[name]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8)


def resolve_kind(setting: ChecksumSetting, device: torch.device) -> ChecksumKind:
    """The kind a source publishes: the plan's setting, `auto` resolved by where the weights
    are (dev64 on CUDA, hashed there with no host copy; xxh3 on the CPU, faster there)."""
    if setting == "auto":
        return "dev64" if device.type == "cuda" else "xxh3"
    for kind in CHECKSUM_KINDS:
        if setting == kind:
            return kind
    raise ValueError(f"unknown checksum setting {setting!r}")


def checksum(tensor: torch.Tensor, kind: ChecksumKind = "xxh3") -> str:
    """Hex digest of a tensor's bytes. xxh3 and crc32 hash CUDA tensors through host memory in
    slices; dev64 hashes them on their device."""
    if kind == "dev64":
        return hexdigest(dev64(tensor))
    flat = tensor_bytes(tensor)
    if kind == "xxh3":
        h = xxhash.xxh3_64()
        for piece in _host_slices(flat):
            h.update(piece.numpy().data)
        return h.hexdigest()
    if kind == "crc32":
        crc = 0
        for piece in _host_slices(flat):
            crc = zlib.crc32(piece.numpy().data, crc)
        return f"{crc:08x}"
    raise ValueError(f"unknown checksum kind {kind!r}")


def _host_slices(flat: torch.Tensor) -> Iterable[torch.Tensor]:
    n = flat.numel()
    if flat.device.type == "cpu":
        # One pass: xxhash releases the GIL on large buffers, slicing is only for CUDA staging.
        yield flat
        return
    staging = torch.empty(min(n, _HASH_SLICE), dtype=torch.uint8, pin_memory=True)
    for start in range(0, n, _HASH_SLICE):
        stop = min(n, start + _HASH_SLICE)
        host = staging[: stop - start]
        host.copy_(flat[start:stop])
        yield host


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Region(_Wire):
    """One registered memory region on the source (few large ones per rank)."""

    addr: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    device_id: int = Field(0, ge=0)


class TensorEntry(_Wire):
    name: str = Field(min_length=1)
    dtype: str
    shape: list[int]
    nbytes: int = Field(ge=0)
    region: int = Field(ge=0)
    offset: int = Field(ge=0)
    checksum: str = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in {self.shape}")
        numel = 1
        for d in self.shape:
            numel *= d
        if numel * element_size(self.dtype) != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: {self.dtype}{self.shape} is "
                f"{numel * element_size(self.dtype)} bytes, manifest says {self.nbytes}"
            )
        return self


class RankManifest(_Wire):
    version: int = MANIFEST_VERSION
    identity: str
    rank: int = Field(ge=0)
    pod: str
    agent: str = Field(min_length=1)
    # base64 of nixl_agent.get_agent_metadata(), for add_remote_agent on the target.
    agent_metadata: str
    mem_type: Literal["DRAM", "VRAM"]
    checksum_kind: ChecksumKind = "xxh3"
    # Who laid the tensors out, when not the checkpoint's own files: an engine's per-rank
    # parameters (`vLLM 0.32.0`), whose names and shapes can stay while their meaning changes
    # between versions (a fused projection's order). A target takes only its own layout.
    # Left out of the JSON when empty, so other manifests are byte for byte as before.
    layout: str = ""
    total_bytes: int = Field(ge=0)
    regions: list[Region]
    tensors: list[TensorEntry]

    @model_validator(mode="after")
    def _in_bounds(self) -> RankManifest:
        seen: set[str] = set()
        total = 0
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} appears twice")
            seen.add(t.name)
            if t.region >= len(self.regions):
                raise ValueError(f"tensor {t.name!r}: region {t.region} does not exist")
            if t.offset + t.nbytes > self.regions[t.region].nbytes:
                raise ValueError(f"tensor {t.name!r}: bytes run past its region")
            total += t.nbytes
        if total != self.total_bytes:
            raise ValueError(f"total_bytes {self.total_bytes} != sum of tensors {total}")
        return self

    def metadata_bytes(self) -> bytes:
        return base64.b64decode(self.agent_metadata)
