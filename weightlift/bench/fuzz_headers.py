"""Malformed safetensors files against every storage loader and the header parser.

A file starts valid (random tensors of random dtypes and shapes, laid out as safetensors does)
and then gets at most one fault: truncation, a lying header length, overlapping offsets, a
wrong or unknown dtype, a huge shape, offsets out of the file, a hole, trailing bytes, broken
JSON or UTF-8, missing or extra keys, bad metadata. Each file goes through the parser
(`read_header`), the shard index and the Preload (mapped and staged) and Direct loaders. The
only allowed outcomes: our `LoadError` naming the file, or (the file still being valid) exactly
the tensors safetensors' own `load_file` returns. Anything else is counted: another exception
type, a message that does not name the file, a hang, or tensors from a file the reference
refuses.
"""

from __future__ import annotations

import json
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hypothesis import strategies as st

JSON = dict[str, Any]
DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1, "F64": 8}
FAULTS = (
    "truncate",
    "length-lie",
    "overlap",
    "wrong-dtype",
    "unknown-dtype",
    "huge-shape",
    "shape-mismatch",
    "offset-out-of-file",
    "negative-offset",
    "hole",
    "trailing-bytes",
    "not-json",
    "bad-utf8",
    "missing-key",
    "extra-key",
    "bad-metadata",
    "not-an-object",
    "empty-file",
    "none",
)
HANG_SECONDS = 20


@dataclass(frozen=True)
class Case:
    fault: str
    blob: bytes


def _layout(tensors: list[tuple[str, str, list[int]]]) -> tuple[JSON, int]:
    header: JSON = {}
    pos = 0
    for name, dtype, shape in tensors:
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header, pos


def _pack(header: Any, data: bytes, declared: int | None = None) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body) if declared is None else declared) + body + data


@st.composite
def cases(draw: st.DrawFn) -> Case:
    count = draw(st.integers(1, 4))
    names = draw(
        st.lists(
            st.text("abcdefgh.", min_size=1, max_size=6),
            min_size=count,
            max_size=count,
            unique=True,
        )
    )
    tensors = [
        (
            n,
            draw(st.sampled_from(sorted(DTYPES))),
            draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)),
        )
        for n in names
    ]
    header, size = _layout(tensors)
    data = bytearray(draw(st.binary(min_size=size, max_size=size)))
    for name, dtype, _ in tensors:
        if dtype in ("BOOL", "F32", "F16", "BF16", "F64"):
            b, e = header[name]["data_offsets"]
            data[b:e] = bytes(e - b)  # zeros: valid booleans, no NaN (NaN != NaN bitwise is
            # fine, but a BOOL byte of 7 is another fault than the one drawn)
    fault = draw(st.sampled_from(FAULTS))
    first = names[0]
    entry = header[first]
    declared: int | None = None
    blob: bytes | None = None
    if fault == "truncate":
        full = _pack(header, bytes(data))
        blob = full[: draw(st.integers(0, max(0, len(full) - 1)))]
    elif fault == "length-lie":
        declared = draw(st.integers(0, 2**64 - 1))
    elif fault == "overlap" and count == 1:
        fault = "none"  # one tensor cannot overlap another
    elif fault == "overlap":
        b, e = header[names[1]]["data_offsets"]
        shift = draw(st.integers(1, max(1, b)))
        header[names[1]]["data_offsets"] = [max(0, b - shift), max(0, e - shift)]
    elif fault == "wrong-dtype":
        others = [d for d in DTYPES if DTYPES[d] != DTYPES[entry["dtype"]]]
        entry["dtype"] = draw(st.sampled_from(others))
    elif fault == "unknown-dtype":
        entry["dtype"] = draw(st.sampled_from(["F128", "f32", "", "I4", 7, None]))
    elif fault == "huge-shape":
        entry["shape"] = draw(st.lists(st.integers(2**20, 2**62), min_size=1, max_size=4))
    elif fault == "shape-mismatch":
        entry["shape"] = [*entry["shape"], draw(st.integers(2, 9))]
    elif fault == "offset-out-of-file":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = [b, e + draw(st.integers(1, 2**40))]
    elif fault == "negative-offset":
        entry["data_offsets"] = [draw(st.integers(-(2**40), -1)), entry["data_offsets"][1]]
    elif fault == "hole":  # a gap before the first tensor: bytes no tensor owns
        gap = draw(st.integers(1, 64))
        data = bytearray(gap) + data
        for name in names:
            b, e = header[name]["data_offsets"]
            header[name]["data_offsets"] = [b + gap, e + gap]
    elif fault == "trailing-bytes":
        data += draw(st.binary(min_size=1, max_size=64))
    elif fault == "not-json":
        body = draw(st.binary(min_size=1, max_size=64))
        blob = struct.pack("<Q", len(body)) + body + bytes(data)
    elif fault == "bad-utf8":
        body = b'{"\xff\xfe":1}'
        blob = struct.pack("<Q", len(body)) + body + bytes(data)
    elif fault == "missing-key":
        del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif fault == "extra-key":
        entry[draw(st.sampled_from(["offset", "x", "__metadata__"]))] = 1
    elif fault == "bad-metadata":
        header["__metadata__"] = draw(st.sampled_from([{"a": 1}, [1], "m", {"a": None}]))
    elif fault == "not-an-object":
        blob = _pack(draw(st.sampled_from([[1, 2], "s", 3, None])), bytes(data))
    elif fault == "empty-file":
        blob = draw(st.binary(max_size=7))
    if blob is None:
        blob = _pack(header, bytes(data), declared)
    return Case(fault, blob)


@dataclass
class HeaderCounts:
    cases: int = 0
    rejected_named: int = 0  # our LoadError, naming the file, from every entry point
    loaded_valid: int = 0  # still a valid file: every loader gave exactly the reference tensors
    other_exception: int = 0
    unnamed_error: int = 0
    hangs: int = 0
    tensors_from_bad_file: int = 0
    by_fault: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def crashes(self) -> int:
        return self.other_exception + self.unnamed_error + self.hangs + self.tensors_from_bad_file


class _Hang(Exception):
    pass


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def on_alarm(_s: int, _f: FrameType | None) -> None:
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def entry_points() -> dict[str, Callable[[Path], Any]]:
    """name -> a call that loads the model dir holding one model.safetensors."""
    import torch

    from weightlift.worker.loaders.direct import DirectLoader
    from weightlift.worker.loaders.preload import PreloadLoader
    from weightlift.worker.weights.files import shard_index
    from weightlift.worker.weights.header import read_header
    from weightlift.worker.weights.progress import LoadProgress

    cpu = torch.device("cpu")

    def loader(make: Callable[[], Any]) -> Callable[[Path], Any]:
        return lambda d: make().load_index(shard_index(d, 0, 1), cpu, LoadProgress())

    return {
        "parser": lambda d: read_header(d / "model.safetensors"),
        "preload-mapped": loader(PreloadLoader),
        "preload-staged": loader(lambda: PreloadLoader(staged=True)),
        "direct": loader(DirectLoader),
    }


def _reference(path: Path) -> dict[str, Any] | None:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception:
        return None


def check_case(case: Case, work: Path, counts: HeaderCounts) -> None:
    from weightlift.worker.weights.progress import LoadError
    from weightlift.worker.weights.tensors import all_bit_equal

    work.mkdir(parents=True, exist_ok=True)
    path = work / "model.safetensors"
    path.write_bytes(case.blob)
    counts.cases += 1
    counts.by_fault[case.fault] = counts.by_fault.get(case.fault, 0) + 1
    outcomes: dict[str, str] = {}
    loaded: dict[str, dict[str, Any]] = {}
    for name, call in entry_points().items():
        try:
            with _deadline(HANG_SECONDS):
                result = call(work)
        except _Hang:
            outcomes[name] = "hang"
        except LoadError as exc:
            outcomes[name] = "named" if str(path) in str(exc) else f"unnamed: {exc}"
        except Exception as exc:
            outcomes[name] = f"exception {type(exc).__name__}: {exc}"
        else:
            outcomes[name] = "ok"
            if name != "parser":
                loaded[name] = result
    if all(o == "named" for o in outcomes.values()):
        counts.rejected_named += 1
        return
    bad = {k: v for k, v in outcomes.items() if v not in ("named", "ok")}
    if any(v == "hang" for v in bad.values()):
        counts.hangs += 1
    elif any(v.startswith("exception") for v in bad.values()):
        counts.other_exception += 1
    elif bad:
        counts.unnamed_error += 1
    if not bad:
        reference = _reference(path)
        ok = reference is not None and all(
            sorted(t) == sorted(reference) and all_bit_equal(t, reference) for t in loaded.values()
        )
        if ok and all(v == "ok" for v in outcomes.values()):
            counts.loaded_valid += 1
            return
        counts.tensors_from_bad_file += 1
        bad = {"mixed": json.dumps(outcomes), "reference": str(reference is not None)}
    if len(counts.examples) < 10:
        counts.examples.append(f"{case.fault}: {bad}")
