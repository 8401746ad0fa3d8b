"""Malformed safetensors files against the parser and every storage loader (a fixed sequence of
1000 cases from `weightlift bench fuzz`): our error naming the file, or the reference's tensors."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from weightlift.bench.fuzz import fuzz_headers
from weightlift.bench.fuzz_headers import FAULTS, Case, HeaderCounts, check_case


def test_thousand_malformed_headers_never_crash_any_loader(tmp_path: Path) -> None:
    counts = fuzz_headers(1000, seed=0, work=tmp_path)
    assert counts.cases == 1000
    assert counts.crashes == 0, counts.examples
    assert counts.rejected_named + counts.loaded_valid == counts.cases
    # The sequence really exercises the faults and the success path.
    assert set(counts.by_fault) == set(FAULTS)
    assert counts.rejected_named > 0.8 * counts.cases
    assert counts.loaded_valid > 0


def test_a_lying_length_is_counted_as_rejected_naming_the_file(tmp_path: Path) -> None:
    counts = HeaderCounts()
    body = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    check_case(Case("length-lie", struct.pack("<Q", 1 << 40) + body + bytes(4)), tmp_path, counts)
    assert counts.rejected_named == 1 and counts.crashes == 0


def test_a_loader_that_raises_something_else_is_counted_as_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count can fail: a loader raising a foreign exception is a crash, not a rejection."""
    import weightlift.bench.fuzz_headers as fh

    real = fh.entry_points

    def broken() -> dict[str, object]:
        points = dict(real())

        def boom(_d: Path) -> None:
            raise KeyError("not ours")

        points["direct"] = boom
        return points

    monkeypatch.setattr(fh, "entry_points", broken)
    counts = HeaderCounts()
    body = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    check_case(Case("none", struct.pack("<Q", len(body)) + body + bytes(4)), tmp_path, counts)
    assert counts.other_exception == 1 and counts.crashes == 1
