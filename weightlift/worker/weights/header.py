"""The safetensors header parser and validator (no torch import; every loader and P2P use it).

File layout: 8-byte little-endian header length N, N bytes of JSON, then the data section.
The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
to the data section) plus an optional "__metadata__" dict of strings.

Everything is checked before a single data byte is read, and every error names the file and,
where there is one, the tensor: truncated files, header lengths beyond the file, non-JSON
headers, unknown dtypes, bad shapes, byte lengths that disagree with dtype x shape, offsets out
of range, overlapping, leaving holes, or trailing bytes after the last tensor (the same rules as
the safetensors reference implementation, so whatever passes here also loads there).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from weightlift.worker.weights.progress import LoadError

# Same bound the safetensors reference uses: a header is never allowed to be bigger than this,
# so a hostile length field cannot make us allocate gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A shape product beyond this cannot be backed by any real file; rejecting early keeps the
# arithmetic cheap on fuzzed input.
MAX_NUMEL = 1 << 62

# The one table of safetensors dtypes: wire name -> (torch dtype attribute, bytes per element).
# Kept torch-free (validating a header needs no torch); weights/tensors.py maps the attribute
# names to torch dtypes, the P2P manifest uses the same names on the wire.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
}
DTYPE_SIZES: dict[str, int] = {name: size for name, (_, size) in SAFETENSORS_DTYPES.items()}


class SafetensorsFormatError(LoadError):
    """A safetensors file is malformed; `path` and `tensor` say where."""

    def __init__(self, path: str, message: str, tensor: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        super().__init__(where + message)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int  # absolute, exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    header_len: int
    file_size: int
    # Ordered by file offset.
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def _shape(path: str, name: str, raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise SafetensorsFormatError(path, f"shape must be a list of integers, got {raw!r}", name)
    dims: list[int] = []
    for d in raw:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise SafetensorsFormatError(path, f"shape {raw!r} has an invalid dimension", name)
        dims.append(d)
    return tuple(dims)


def parse_header(prefix: bytes, file_size: int, path: str) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file.

    `prefix` holds at least the first 8 + N bytes of the file (it may be the whole file);
    `file_size` is the full size on disk. Raises SafetensorsFormatError naming file and tensor.
    """
    n, doc = _header_json(prefix, file_size, path)
    metadata = _metadata(path, doc.pop("__metadata__", None))
    data_start = 8 + n
    data_len = file_size - data_start
    infos = [_tensor_info(path, name, entry, data_start, data_len) for name, entry in doc.items()]
    infos.sort(key=lambda t: (t.begin, t.end))
    _check_contiguous(path, infos, data_start, file_size)
    return SafetensorsHeader(
        path=path,
        header_len=n,
        file_size=file_size,
        tensors={t.name: t for t in infos},
        metadata=metadata,
    )


def _header_json(prefix: bytes, file_size: int, path: str) -> tuple[int, dict[str, Any]]:
    """(header length N, the header's JSON object), every bound checked."""
    if file_size < 8 or len(prefix) < 8:
        raise SafetensorsFormatError(path, f"truncated: {file_size} bytes, too short for a header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(
            path, f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )
    if 8 + n > file_size:
        raise SafetensorsFormatError(
            path, f"header length {n} goes beyond the end of the file ({file_size} bytes)"
        )
    if len(prefix) < 8 + n:
        raise SafetensorsFormatError(path, f"truncated: header needs {8 + n} bytes")
    try:
        doc = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsFormatError(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SafetensorsFormatError(path, "header is not a JSON object")
    return n, doc


def _metadata(path: str, raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise SafetensorsFormatError(path, "__metadata__ must map strings to strings")
    return dict(raw)


def _tensor_info(path: str, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
    """One header entry, validated: dtype, shape, offsets within the data, size = dtype x shape."""
    if not isinstance(entry, dict):
        raise SafetensorsFormatError(path, "entry is not an object", name)
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    missing = {"dtype", "shape", "data_offsets"} - set(entry)
    if missing:
        raise SafetensorsFormatError(path, f"entry lacks {sorted(missing)}", name)
    if extra:
        raise SafetensorsFormatError(path, f"entry has unknown keys {sorted(extra)}", name)
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsFormatError(path, f"unknown dtype {dtype!r}", name)
    shape = _shape(path, name, entry["shape"])
    begin, end = _offsets(path, name, entry["data_offsets"], data_len)
    numel = 1
    for d in shape:
        numel *= d
        if numel > MAX_NUMEL:
            raise SafetensorsFormatError(path, f"shape {list(shape)} is absurdly large", name)
    expected = numel * DTYPE_SIZES[dtype]
    if expected != end - begin:
        raise SafetensorsFormatError(
            path,
            f"dtype {dtype} x shape {list(shape)} needs {expected} bytes "
            f"but data_offsets {[begin, end]} span {end - begin}",
            name,
        )
    return TensorInfo(name, dtype, shape, data_start + begin, data_start + end)


def _offsets(path: str, name: str, offs: Any, data_len: int) -> tuple[int, int]:
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
    ):
        raise SafetensorsFormatError(
            path, f"data_offsets must be [begin, end] integers, got {offs!r}", name
        )
    begin, end = offs
    if begin < 0 or end < begin:
        raise SafetensorsFormatError(path, f"data_offsets {offs} are invalid", name)
    if end > data_len:
        raise SafetensorsFormatError(
            path,
            f"data_offsets {offs} go beyond the data section ({data_len} bytes): "
            "the file is truncated or the offsets are out of range",
            name,
        )
    return begin, end


def _check_contiguous(path: str, infos: list[TensorInfo], data_start: int, size: int) -> None:
    """Sorted tensors cover the data section exactly: no overlap, no hole, nothing trailing."""
    pos = data_start
    prev: TensorInfo | None = None
    for t in infos:
        if t.begin < pos:
            assert prev is not None
            raise SafetensorsFormatError(
                path, f"data overlaps tensor {prev.name!r} (offsets must not overlap)", t.name
            )
        if t.begin > pos:
            raise SafetensorsFormatError(
                path, f"leaves a hole of {t.begin - pos} bytes before its data", t.name
            )
        pos = t.end
        prev = t
    if pos != size:
        raise SafetensorsFormatError(
            path, f"{size - pos} trailing bytes after the last tensor's data"
        )


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate one file's header (reads only 8 + N bytes)."""
    p = str(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(p, f"truncated: {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return parse_header(head, size, p)  # raises with the precise reason
            body = f.read(n)
    except OSError as exc:
        raise SafetensorsFormatError(p, f"cannot read: {exc.strerror or exc}") from None
    return parse_header(head + body, size, p)
