"""Tensor helpers shared by the loaders: safetensors dtype names <-> torch, byte views."""

from __future__ import annotations

import torch

from weightlift.worker.loaders.header import TensorInfo

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


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
