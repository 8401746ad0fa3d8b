"""The shared ranged-GET plan (worker/storage/ranged.py) that s3:// and hf:// downloads follow."""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from weightlift.worker.storage.ranged import Sink, drain, fetch_files, ranges


@dataclass(frozen=True)
class File:
    name: str
    size: int


def test_ranges_cover_every_byte_once_with_every_header_first() -> None:
    files = [File("b.safetensors", 100), File("a.safetensors", 35), File("empty.json", 0)]
    jobs = ranges(files, 16)
    for f in files:
        spans = sorted((s, n) for g, s, n in jobs if g == f)
        assert sum(n for _, n in spans) == f.size
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
    # the first range of each file comes before any file's second range
    assert [(g.name, s) for g, s, _ in jobs[:2]] == [("a.safetensors", 0), ("b.safetensors", 0)]


def test_drain_hands_over_offsets_and_stops_at_a_short_body() -> None:
    body = io.BytesIO(bytes(range(200)) * 20000)  # 4 MB: several passes through the buffer
    out = bytearray(3_000_000)

    def sink(piece: memoryview, offset: int) -> None:
        out[offset - 1000 : offset - 1000 + len(piece)] = piece

    assert drain(body.readinto, 1000, 3_000_000, sink) == 3_000_000
    assert bytes(out) == body.getvalue()[:3_000_000]
    assert drain(io.BytesIO(b"abc").readinto, 0, 10, lambda _p, _o: None) == 3


def test_fetch_files_renames_complete_files_into_place_and_leaves_nothing_on_failure(
    tmp_path: Path,
) -> None:
    data = {"a.safetensors": bytes(range(256)) * 1000, "sub/b.json": b"{}"}
    files = [File(name, len(b)) for name, b in data.items()]
    old = tmp_path / "a.safetensors"
    old.write_bytes(b"old contents")
    with old.open("rb") as held:  # someone holds the previous file open: it stays intact

        def read(f: File, start: int, n: int, sink: Sink) -> None:
            sink(memoryview(data[f.name][start : start + n]), start)

        paths = fetch_files(files, tmp_path, read, lambda _n: None, threads=3, chunk_bytes=1000)
        assert held.read() == b"old contents"
    assert {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in paths} == data

    def broken(f: File, start: int, n: int, sink: Sink) -> None:
        if start >= 5000:
            raise OSError(f"{f.name}: connection reset at {start}")
        sink(memoryview(data[f.name][start : start + n]), start)

    with pytest.raises(OSError, match="connection reset"):
        fetch_files(files, tmp_path / "again", broken, lambda _n: None, threads=3, chunk_bytes=1000)
    assert [p for p in (tmp_path / "again").rglob("*") if p.is_file()] == []
