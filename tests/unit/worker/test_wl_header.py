"""The safetensors header validator: every bad input is a clear error naming file and tensor."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.header import (
    MAX_HEADER_BYTES,
    SafetensorsFormatError,
    parse_header,
    read_header,
)


def raw_file(path: Path, header: Any, data: bytes, header_bytes: bytes | None = None) -> Path:
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def good_header() -> dict[str, Any]:
    return {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [3], "data_offsets": [16, 22]},
    }


def test_valid_file_matches_safetensors(tmp_path: Path) -> None:
    tensors = {"x": torch.randn(3, 5), "y": torch.arange(7, dtype=torch.int64)}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p), metadata={"k": "v"})
    h = read_header(p)
    assert set(h.tensors) == {"x", "y"}
    assert h.tensors["x"].shape == (3, 5) and h.tensors["x"].dtype == "F32"
    assert h.tensors["x"].nbytes == 60 and h.tensors["y"].nbytes == 56
    assert h.metadata == {"k": "v"}
    assert h.data_start + 116 == h.file_size == p.stat().st_size
    raw = p.read_bytes()
    got = torch.frombuffer(
        bytearray(raw[h.tensors["x"].begin : h.tensors["x"].end]), dtype=torch.float32
    )
    assert torch.equal(got.view(3, 5), tensors["x"])


def test_raw_good_file_parses(tmp_path: Path) -> None:
    h = read_header(raw_file(tmp_path / "g.safetensors", good_header(), bytes(22)))
    assert list(h.tensors) == ["a", "b"]


@pytest.mark.parametrize(
    ("header", "data", "header_bytes", "tensor", "needle"),
    [
        (None, b"", b"{not json", None, "not valid JSON"),
        (None, b"", b"\xff\xfe", None, "not valid JSON"),
        ([1, 2], b"", None, None, "not a JSON object"),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            bytes(10),
            None,
            "a",
            "beyond the data section",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
            bytes(12),
            None,
            "a",
            "needs 16 bytes",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            None,
            "b",
            "overlaps tensor 'a'",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            bytes(8),
            None,
            "a",
            "hole of 4 bytes",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            bytes(8),
            None,
            None,
            "4 trailing bytes",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
            bytes(8),
            None,
            "a",
            "invalid",
        ),
        (
            {"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "a",
            "unknown dtype",
        ),
        (
            {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "a",
            "invalid dimension",
        ),
        (
            {"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "a",
            "shape must be a list",
        ),
        ({"a": {"dtype": "F32", "shape": [1]}}, bytes(4), None, "a", "lacks ['data_offsets']"),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}},
            bytes(4),
            None,
            "a",
            "unknown keys",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}},
            bytes(4),
            None,
            "a",
            "integers",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "a",
            "absurdly large",
        ),
        ({"__metadata__": {"k": 1}}, b"", None, None, "__metadata__"),
    ],
)
def test_bad_headers_name_file_and_tensor(
    tmp_path: Path,
    header: Any,
    data: bytes,
    header_bytes: bytes | None,
    tensor: str | None,
    needle: str,
) -> None:
    p = raw_file(tmp_path / "bad.safetensors", header, data, header_bytes)
    with pytest.raises(SafetensorsFormatError) as ei:
        read_header(p)
    msg = str(ei.value)
    assert str(p) in msg and needle in msg
    assert ei.value.path == str(p) and ei.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in msg


def test_truncated_file(tmp_path: Path) -> None:
    src = tmp_path / "ok.safetensors"
    save_file({"w": torch.randn(64, 64), "v": torch.randn(8)}, str(src))
    raw = src.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-100])
    with pytest.raises(SafetensorsFormatError, match=r"cut\.safetensors: tensor '(w|v)'.*beyond"):
        read_header(cut)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(raw[:5])
    with pytest.raises(SafetensorsFormatError, match="too short"):
        read_header(tiny)


def test_header_length_beyond_file(tmp_path: Path) -> None:
    p = tmp_path / "long.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(SafetensorsFormatError, match="header length 1000 goes beyond the end"):
        read_header(p)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(SafetensorsFormatError, match="exceeds the limit"):
        read_header(huge)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(Exception, match=r"tensor 'a' appears in both .*00001.*00002"):
        shard_index(tmp_path, 0, 1)


_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
_entry = st.fixed_dictionaries(
    {
        "dtype": st.one_of(
            st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "X"]), _json_scalar
        ),
        "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), _json_scalar),
        "data_offsets": st.one_of(
            st.lists(st.integers(-4, 2**62), min_size=0, max_size=3), _json_scalar
        ),
    }
)
_header = st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json_scalar), max_size=5)


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    header=_header,
    data=st.binary(max_size=64),
    declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_fuzz_structured_headers(header: dict[str, Any], data: bytes, declared: int | None) -> None:
    body = json.dumps(header).encode()
    n = len(body) if declared is None else declared
    blob = struct.pack("<Q", n) + body + data
    try:
        h = parse_header(blob, len(blob), "fuzz.safetensors")
    except SafetensorsFormatError as exc:
        assert str(exc).startswith("fuzz.safetensors: ")
        return
    # Anything accepted is internally consistent: tensors tile the data section exactly.
    pos = h.data_start
    for t in h.tensors.values():
        assert t.begin == pos and t.end >= t.begin
        pos = t.end
    assert pos == len(blob)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(blob=st.binary(max_size=256))
def test_fuzz_random_bytes(blob: bytes) -> None:
    with contextlib.suppress(SafetensorsFormatError):
        parse_header(blob, len(blob), "r.safetensors")


def test_header_limit_constant() -> None:
    assert MAX_HEADER_BYTES == 100 * 1024 * 1024
