"""Tensor helpers shared by the loaders: safetensors dtype names <-> torch, byte views."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from weightlift.worker.weights.header import DTYPE_SIZES, SAFETENSORS_DTYPES, TensorInfo

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, (attr, _) in SAFETENSORS_DTYPES.items()
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


def view_tensor(buf: torch.Tensor, start: int, info: TensorInfo) -> torch.Tensor:
    """Tensor `info` as a view of the flat uint8 `buf` at byte `start` (a copy if misaligned)."""
    dtype = TORCH_DTYPES[info.dtype]
    raw = buf[start : start + info.nbytes]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype, device=buf.device)
    try:
        return raw.view(dtype).view(info.shape)
    except RuntimeError:
        # Unaligned offset: torch cannot reinterpret in place; one copy into an aligned tensor.
        out = torch.empty(info.shape, dtype=dtype, device=buf.device)
        out.view(-1).view(torch.uint8).copy_(raw)
        return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ab = a.detach().contiguous().cpu().view(-1).view(torch.uint8)
    bb = b.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return bool(torch.equal(ab, bb))


def all_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


# Canonical placement: where each tensor's first byte sits modulo TENSOR_ALIGNMENT, the same on
# every replica of a device kind. Why it matters: BLAS kernels pick their code path by the
# operands' alignment, and the paths round differently. Measured here (torch 2.x with MKL,
# AVX2): F.linear of a [1, 512] input with the same fp32 weight bytes at 16-byte-aligned vs
# 8-byte-aligned addresses differs by up to 1.5e-6, so the same weights at different addresses
# gave different outputs per load path. The rule (`canonical_residue`):
#  - host memory: the tensor's offset in its safetensors file (8 + header length + data begin),
#    i.e. where a page-aligned mapping of the file puts it. Mapping a file is then a valid load
#    with no byte copied (headers are padded to 8 bytes only, so most files' tensors are not
#    64-byte aligned); fresh buffers (P2P targets, staged reads, copies) place each tensor at
#    that residue. A tensor whose offset is not a multiple of its element size cannot be
#    viewed in place (torch refuses), so every path copies it into fresh memory: residue 0,
#    as for tensors a cast makes.
#  - CUDA: 0. Every CUDA allocation starts 256-byte aligned and vectorised kernels want aligned
#    operands; safetensors, fastsafetensors and our staged path all hand out aligned device
#    tensors, and there is no mapping to spare a copy of.
# A P2P target places each tensor at its source's address mod 64 (the source follows the rule;
# a host target of a CUDA source thus gets 0: bit-identity holds within one device kind).
TENSOR_ALIGNMENT = 64


def canonical_residue(device: torch.device, file_offset: int, element_size: int) -> int:
    """Where a tensor at `file_offset` in its file (or at that address on a source that follows
    this rule) sits modulo TENSOR_ALIGNMENT on `device` (the rule above)."""
    if device.type == "cuda" or file_offset % element_size:
        return 0
    return file_offset % TENSOR_ALIGNMENT


def residue_of(t: torch.Tensor) -> int:
    return t.data_ptr() % TENSOR_ALIGNMENT


def file_residues(tensors: Iterable[TensorInfo], device: torch.device) -> dict[str, int]:
    """name -> canonical residue on `device` of each tensor of a file's header."""
    return {t.name: canonical_residue(device, t.begin, DTYPE_SIZES[t.dtype]) for t in tensors}


def misplaced(tensors: Mapping[str, torch.Tensor], residues: Mapping[str, int]) -> list[str]:
    """Names of non-empty tensors not at their residue (names missing from `residues` pass)."""
    return [
        k
        for k, t in tensors.items()
        if t.numel() and k in residues and residue_of(t) != residues[k]
    ]


def place(
    tensors: dict[str, torch.Tensor], residues: Mapping[str, int]
) -> tuple[dict[str, torch.Tensor], int]:
    """`tensors` with every one not at its residue copied into one fresh buffer per device,
    placed there (the rest are returned as they are). Returns the tensors and the bytes copied."""
    moved = misplaced(tensors, residues)
    if not moved:
        return tensors, 0
    out = dict(tensors)
    by_device: dict[torch.device, list[str]] = {}
    for k in moved:
        by_device.setdefault(tensors[k].device, []).append(k)
    for device, names in by_device.items():
        out.update(pack({k: tensors[k] for k in names}, device, residues))
    return out, sum(tensors[k].numel() * tensors[k].element_size() for k in moved)


def slot_bytes(nbytes: int) -> int:
    """Room one tensor takes in a packed buffer: its bytes at any residue, the next tensor's
    slot starting TENSOR_ALIGNMENT-aligned again (so a layout's size is the same whatever the
    residues and the order)."""
    return -(-(nbytes + TENSOR_ALIGNMENT - 1) // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def pack(
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    residues: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Copies of `tensors` as views of one fresh buffer on `device` (one allocation, one memory
    region to register for P2P), each at its residue (default 0)."""
    want = residues or {}
    offsets: list[int] = []
    total = 0
    for k, t in tensors.items():
        offsets.append(total + want.get(k, 0))
        total += slot_bytes(t.numel() * t.element_size())
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    assert buf.data_ptr() % TENSOR_ALIGNMENT == 0, "torch's allocator is aligned"
    out: dict[str, torch.Tensor] = {}
    for (k, t), off in zip(tensors.items(), offsets, strict=True):
        n = t.numel() * t.element_size()
        dst = buf[off : off + n].view(t.dtype).view(t.shape)
        dst.copy_(t.detach())
        out[k] = dst
    return out
