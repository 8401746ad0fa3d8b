"""The operator's glibc malloc settings (operator/malloc.py), each checked in a fresh process:
they change that process's allocator for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc only",
)

# A 1 MB block freed (glibc then raises its mmap threshold to 1 MB when left dynamic), then a
# 200 KB block: does it come from mmap (mallinfo2's hblks counts mmapped blocks)?
PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    from weightlift.operator.malloc import tune_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    applied = tune_malloc() if sys.argv[1] == "tuned" else {}
    libc.free(libc.malloc(1 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(200 * 1024)
    mmapped = libc.mallinfo2().hblks - before
    libc.free(block)
    print(json.dumps({"applied": applied, "mmapped": mmapped}))
    """
)


def _probe(mode: str, **env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=environ, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_thresholds_stay_fixed_after_a_large_block_is_freed() -> None:
    assert _probe("default")["mmapped"] == 0  # glibc's dynamic threshold: the heap serves it
    tuned = _probe("tuned")
    assert tuned["mmapped"] == 1
    assert tuned["applied"] == {
        "MALLOC_ARENA_MAX": 2,
        "MALLOC_MMAP_THRESHOLD_": 128 * 1024,
        "MALLOC_TRIM_THRESHOLD_": 256 * 1024,
    }


def test_a_variable_glibc_reads_wins() -> None:
    tuned = _probe("tuned", MALLOC_MMAP_THRESHOLD_=str(4 << 20), MALLOC_ARENA_MAX="4")
    assert tuned["applied"] == {"MALLOC_TRIM_THRESHOLD_": 256 * 1024}
    assert tuned["mmapped"] == 0  # the 4 MB threshold from the environment holds
