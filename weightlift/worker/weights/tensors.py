"""Tensor helpers shared by the loaders: safetensors dtype names <-> torch, byte views."""

from __future__ import annotations

import torch

from weightlift.worker.weights.header import SAFETENSORS_DTYPES, TensorInfo

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


# Every tensor a loader hands the runtime starts at a multiple of this many bytes (torch's own
# CPU allocator alignment; CUDA's is larger). Why it matters: BLAS kernels pick their code path
# by the operands' alignment, and the paths round differently. Measured here (torch 2.x with
# MKL, AVX2): F.linear of a [1, 512] input with the same fp32 weight bytes at 16-byte-aligned
# vs 8-byte-aligned addresses differs by up to 1.5e-6. Tensors mapped straight from a
# safetensors file sit at the file's offsets (headers are padded to 8 bytes only), while fresh
# buffers (P2P targets, CUDA) are aligned: the same weights gave different outputs per load path.
TENSOR_ALIGNMENT = 64


def is_aligned(t: torch.Tensor) -> bool:
    return t.numel() == 0 or t.data_ptr() % TENSOR_ALIGNMENT == 0


def realign(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """`tensors` with every misaligned one copied into one fresh, aligned buffer per device
    (aligned ones are returned as they are). Returns the tensors and the bytes copied."""
    moved = [k for k, t in tensors.items() if not is_aligned(t)]
    if not moved:
        return tensors, 0
    out = dict(tensors)
    by_device: dict[torch.device, list[str]] = {}
    for k in moved:
        by_device.setdefault(tensors[k].device, []).append(k)
    for device, names in by_device.items():
        out.update(pack({k: tensors[k] for k in names}, device))
    return out, sum(tensors[k].numel() * tensors[k].element_size() for k in moved)


def pack(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies of `tensors` as aligned views of one fresh buffer on `device` (one allocation, one
    memory region to register for P2P)."""
    offsets: list[int] = []
    total = 0
    for t in tensors.values():
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    assert buf.data_ptr() % TENSOR_ALIGNMENT == 0, "torch's allocator is aligned"
    out: dict[str, torch.Tensor] = {}
    for (k, t), off in zip(tensors.items(), offsets, strict=True):
        n = t.numel() * t.element_size()
        dst = buf[off : off + n].view(t.dtype).view(t.shape)
        dst.copy_(t.detach())
        out[k] = dst
    return out
