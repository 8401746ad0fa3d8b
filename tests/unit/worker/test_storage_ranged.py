"""The shared ranged-GET plan (worker/storage/ranged.py) that s3:// and hf:// downloads follow."""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass

from weightlift.worker.storage.ranged import drain, ranges


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
