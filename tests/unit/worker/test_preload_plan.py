"""Preload's pure planning: read chunks (page-aligned windows), the device layout, copies, the
staging pool's size, reader threads from the pod's cgroup. No I/O but fake cgroup files; <1 s."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.worker import pad_header
from weightlift.worker.loaders import podlimits
from weightlift.worker.loaders.layout import IO_ALIGN, Chunk, chunks, copies, segments
from weightlift.worker.loaders.staging import MAX_POOL_BYTES, MIN_SLOT_BYTES, pool_geometry
from weightlift.worker.weights.files import index_files
from weightlift.worker.weights.header import SafetensorsHeader
from weightlift.worker.weights.tensors import TENSOR_ALIGNMENT, TORCH_DTYPES, canonical_residue

A = IO_ALIGN


@pytest.mark.parametrize(
    ("data_start", "size", "step"),
    [(88, 88 + 5 * A + 7, 2 * A), (A + 8, 3 * A, A), (8, 9, 64 << 20), (4000, 4000 + A, A + 5)],
)
def test_chunks_are_aligned_windows_covering_the_data_once(
    data_start: int, size: int, step: int
) -> None:
    got = chunks(2, data_start, size, step)
    assert all(c.file_no == 2 for c in got)
    assert got[0].start == data_start // A * A
    for c in got:
        assert c.start % A == 0 and c.read_len % A == 0  # O_DIRECT and page-window aligned
        assert c.start + c.read_len <= -(-size // A) * A  # never past the file's last page
        assert c.start <= c.data_lo < c.data_hi <= c.start + c.read_len
    spans = [(c.data_lo, c.data_hi) for c in got]
    assert spans[0][0] == data_start and spans[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gap, no overlap
    assert max(c.read_len for c in got) <= max(A, step // A * A)


def test_chunks_of_an_empty_data_section() -> None:
    assert chunks(0, 100, 100, A) == []


def _headers(tmp_path: Path, residue: int) -> list[SafetensorsHeader]:
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a": torch.randn(5, generator=g),  # 20 bytes: what follows is off 64
            "b": torch.randint(0, 9, (3,), dtype=torch.uint8, generator=g),  # then off 4
            "c": torch.randn(64, generator=g),
            "d": torch.randn(16, generator=g).to(torch.bfloat16),
            "e": torch.empty(0),
        },
        str(path),
    )
    pad_header(path, residue)
    return index_files([path]).files


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("residue", [0, 8, 40])
def test_layout_places_every_tensor_at_its_residue_once(
    tmp_path: Path, device: str, residue: int
) -> None:
    files = _headers(tmp_path, residue)
    dev = torch.device(device)
    lay = segments(files, lambda off, size: canonical_residue(dev, off, size))
    infos = {n: i for h in files for n, i in h.tensors.items()}
    ends = []
    for name, info in infos.items():
        if info.nbytes == 0:
            continue
        off = lay.offsets[name]
        want = canonical_residue(
            dev, info.begin, torch.empty(0, dtype=TORCH_DTYPES[info.dtype]).element_size()
        )
        assert off % TENSOR_ALIGNMENT == want, name
        ends.append((off, off + info.nbytes))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))  # no overlap
    data = sum(h.data_bytes for h in files)
    assert data <= lay.nbytes <= data + TENSOR_ALIGNMENT * len(lay.segments)
    # Each tensor lies inside one segment, at the segment's own offset.
    for name, info in infos.items():
        if info.nbytes:
            (seg,) = [
                s
                for s in lay.segments
                if s.file_offset <= info.begin and info.end <= s.file_offset + s.length
            ]
            assert lay.offsets[name] == seg.buf_offset + info.begin - seg.file_offset


def test_layout_keeps_aligned_runs_in_one_segment(tmp_path: Path) -> None:
    files = _headers(tmp_path, 0)
    cpu = segments(files, lambda off, size: canonical_residue(torch.device("cpu"), off, size))
    cuda = segments(files, lambda off, size: canonical_residue(torch.device("cuda"), off, size))
    # Host: only the bf16 tensor after the 3-byte one is off its element size (starts anew);
    # CUDA: every tensor off a 64-byte boundary starts a segment.
    assert len(cpu.segments) < len(cuda.segments) <= 4


def test_copies_move_each_data_byte_exactly_once(tmp_path: Path) -> None:
    files = _headers(tmp_path, 40)
    h = files[0]
    lay = segments(files, lambda off, size: canonical_residue(torch.device("cuda"), off, size))
    seen: dict[int, int] = {}  # buffer byte -> file byte
    for c in chunks(0, h.data_start, h.file_size, A):
        for cp in copies(c, lay.segments):
            assert cp.src_offset >= 0 and cp.src_offset + cp.length <= c.read_len
            for k in range(cp.length):
                assert cp.dst_offset + k not in seen
                seen[cp.dst_offset + k] = c.start + cp.src_offset + k
    assert sorted(seen.values()) == list(range(h.data_start, h.file_size))
    assert copies(Chunk(1, 0, A, 0, A), lay.segments) == []  # another file's chunk


def test_pool_geometry_from_the_memory_limit() -> None:
    # Plenty of memory: (readers + 2) chunk-sized slots per rank.
    g = pool_geometry(256 << 30, readers=16, chunk_bytes=64 << 20, ranks=1)
    assert (g.slots, g.slot_bytes) == (18, 64 << 20)
    # Eight ranks would want 9 GiB: capped at MAX_POOL_BYTES, slots shrink first.
    g = pool_geometry(256 << 30, readers=16, chunk_bytes=64 << 20, ranks=8)
    assert g.nbytes <= MAX_POOL_BYTES and g.slots == 8 * 18 and g.slot_bytes % A == 0
    # A 1 GiB pod: at most 1/16 of it.
    g = pool_geometry(1 << 30, readers=8, chunk_bytes=64 << 20)
    assert g.nbytes <= (1 << 30) // 16 and g.slot_bytes >= MIN_SLOT_BYTES and g.slots >= 2
    # Tiny: never fewer than 2 slots of MIN_SLOT_BYTES.
    g = pool_geometry(1 << 20, readers=8, chunk_bytes=64 << 20)
    assert (g.slots, g.slot_bytes) == (2, MIN_SLOT_BYTES)
    # Unknown limit: the absolute cap.
    assert pool_geometry(0, 4, 64 << 20).nbytes <= MAX_POOL_BYTES


def _cgroup(tmp_path: Path, cpu_max: str | None, memory_max: str | None = None) -> Path:
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    if memory_max is not None:
        (tmp_path / "memory.max").write_text(memory_max + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("cpu_max", "limit"),
    [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5), ("50000", 0.5)],
)
def test_cpu_limit_from_cpu_max(tmp_path: Path, cpu_max: str, limit: float | None) -> None:
    assert podlimits.cpu_limit(_cgroup(tmp_path, cpu_max)) == limit


def test_cpu_limit_unreadable_or_garbled(tmp_path: Path) -> None:
    assert podlimits.cpu_limit(tmp_path) is None
    assert podlimits.cpu_limit(_cgroup(tmp_path, "lots 100000")) is None


def test_reader_threads_follow_the_cpu_limit_within_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podlimits.os, "sched_getaffinity", lambda _: set(range(96)))
    assert podlimits.reader_threads(_cgroup(tmp_path, "1200000 100000")) == 12
    assert podlimits.reader_threads(_cgroup(tmp_path, "1250000 100000")) == 13  # rounded up
    assert podlimits.reader_threads(_cgroup(tmp_path, "100000 100000")) == podlimits.MIN_READERS
    assert podlimits.reader_threads(_cgroup(tmp_path, "max 100000")) == podlimits.MAX_READERS
    # No quota: the CPUs the process may run on.
    monkeypatch.setattr(podlimits.os, "sched_getaffinity", lambda _: set(range(10)))
    assert podlimits.reader_threads(_cgroup(tmp_path, "max 100000")) == 10
    # A quota above the pinned CPUs: the pinned CPUs.
    assert podlimits.reader_threads(_cgroup(tmp_path, "3200000 100000")) == 10


def test_memory_limit_from_memory_max_else_memtotal(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemAvailable:    8192 kB\n")
    root = tmp_path / "cg"
    root.mkdir()
    assert podlimits.memory_limit(_cgroup(root, None, "8589934592"), meminfo) == 8 << 30
    assert podlimits.memory_limit(_cgroup(root, None, "max"), meminfo) == 16384 * 1024
