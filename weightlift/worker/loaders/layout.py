"""Where the staged preload puts every byte: pure planning, no I/O.

Device layout (`segments`): each file's data is copied into one buffer as a few contiguous
segments, each tensor landing at its canonical residue (weights/tensors.py: its file offset mod
64 on the host, 0 on CUDA). Consecutive tensors that already sit right share a segment; a tensor
that would not starts a new one, a few bytes further on. So every tensor is a view of the one
buffer and `place` copies nothing: no tensor is held twice (before, a CUDA tensor off a 64-byte
boundary was copied again on the device while the original buffer stayed alive).

Reads (`chunks`): each file is read in chunks that start on an I/O-aligned file offset (so the
same chunk can be read with O_DIRECT, or registered as a page-aligned window of a mapping), from
the aligned page holding the data start to the end of the file; each chunk knows which of its
bytes are data. `copies` maps one chunk onto the segments it feeds.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from weightlift.worker.weights.header import DTYPE_SIZES, SafetensorsHeader
from weightlift.worker.weights.tensors import TENSOR_ALIGNMENT

# O_DIRECT's usual logical-block alignment; a page, so a chunk is also a page-aligned window.
IO_ALIGN = max(4096, mmap.PAGESIZE)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def round_down(n: int, to: int) -> int:
    return n // to * to


@dataclass(frozen=True)
class Segment:
    """File bytes [file_offset, file_offset + length) of file `file_no` at buffer `buf_offset`."""

    file_no: int
    file_offset: int
    length: int
    buf_offset: int


@dataclass(frozen=True)
class Layout:
    segments: list[Segment]  # sorted by (file_no, file_offset)
    offsets: dict[str, int]  # tensor name -> its byte offset in the buffer
    nbytes: int  # the buffer's size


def segments(files: Sequence[SafetensorsHeader], residue: Callable[[int, int], int]) -> Layout:
    """The device layout of `files`; `residue(file_offset, element_size)` is the canonical
    residue mod TENSOR_ALIGNMENT of a tensor at that file offset on the target device."""
    segs: list[Segment] = []
    offsets: dict[str, int] = {}
    pos = 0
    for i, h in enumerate(files):
        cur: Segment | None = None
        for info in sorted(h.tensors.values(), key=lambda t: t.begin):
            if info.nbytes == 0:
                offsets[info.name] = pos  # an empty tensor is never viewed (view_tensor)
                continue
            want = residue(info.begin, DTYPE_SIZES[info.dtype])
            if cur is not None and cur.file_offset + cur.length == info.begin:
                at = cur.buf_offset + info.begin - cur.file_offset
                if at % TENSOR_ALIGNMENT == want:
                    cur = Segment(i, cur.file_offset, cur.length + info.nbytes, cur.buf_offset)
                    segs[-1] = cur
                    offsets[info.name] = at
                    pos = at + info.nbytes
                    continue
            start = pos + (want - pos) % TENSOR_ALIGNMENT
            cur = Segment(i, info.begin, info.nbytes, start)
            segs.append(cur)
            offsets[info.name] = start
            pos = start + info.nbytes
    return Layout(segs, offsets, pos)


@dataclass(frozen=True)
class Chunk:
    """Read file bytes [start, start + read_len) (aligned start, aligned length: it may run
    past the end of the file; the bytes that exist are what counts); [data_lo, data_hi) are the
    data bytes in it (file offsets)."""

    file_no: int
    start: int
    read_len: int
    data_lo: int
    data_hi: int

    @property
    def data_bytes(self) -> int:
        return self.data_hi - self.data_lo


def chunks(
    file_no: int, data_start: int, file_size: int, chunk_bytes: int, align: int = IO_ALIGN
) -> list[Chunk]:
    """One file's reads: from the aligned offset holding `data_start` to `file_size`, in
    chunks of `chunk_bytes` (rounded down to `align`, at least `align`)."""
    if file_size <= data_start:
        return []
    step = max(align, round_down(chunk_bytes, align))
    out: list[Chunk] = []
    pos = round_down(data_start, align)
    while pos < file_size:
        end = min(pos + step, file_size)
        out.append(Chunk(file_no, pos, round_up(end - pos, align), max(pos, data_start), end))
        pos += step
    return out


@dataclass(frozen=True)
class Copy:
    src_offset: int  # in the chunk's bytes (0 = the chunk's start)
    dst_offset: int  # in the device buffer
    length: int


def copies(chunk: Chunk, segs: Sequence[Segment]) -> list[Copy]:
    """The copies that move `chunk`'s data into the buffer: one per segment it overlaps."""
    out: list[Copy] = []
    for s in segs:
        if s.file_no != chunk.file_no:
            continue
        lo = max(chunk.data_lo, s.file_offset)
        hi = min(chunk.data_hi, s.file_offset + s.length)
        if lo < hi:
            out.append(Copy(lo - chunk.start, s.buf_offset + lo - s.file_offset, hi - lo))
    return out
