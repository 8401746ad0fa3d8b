"""The machine's own limits for `bench gpu`, measured in the same run as the loaders: pinned and
pageable host-to-device copies, device-to-device, O_DIRECT reads of the model files, host memcpy;
and the page-cache drop the cold runs rely on, checked with mincore rather than assumed."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightlift.bench.load import drop_cache, odirect_read_gbps
from weightlift.bench.measure import memcpy_gbps

JSON = dict[str, Any]
# A drop that leaves more than this share of the files' pages cached did not happen.
DROPPED_BELOW = 0.05


def spread(seconds: Sequence[float], nbytes: int) -> JSON:
    """Median GB/s of timed runs, with the slowest and fastest run beside it."""
    med = statistics.median(seconds)
    return {
        "gbps": round(nbytes / med / 1e9, 3),
        "seconds": round(med, 5),
        "min_gbps": round(nbytes / max(seconds) / 1e9, 3),
        "max_gbps": round(nbytes / min(seconds) / 1e9, 3),
        "runs": len(seconds),
    }


def timed(fn: Callable[[], object], repeat: int, sync: torch.device | None) -> list[float]:
    """Wall seconds of `fn` per run, the device synchronised before the clock stops."""
    out = []
    for _ in range(repeat):
        if sync is not None:
            torch.cuda.synchronize(sync)
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            torch.cuda.synchronize(sync)
        out.append(time.perf_counter() - t0)
    return out


def copy_limits(device: torch.device, nbytes: int, repeat: int) -> JSON:
    """Pinned and pageable host-to-device and device-to-device copies of `nbytes` (bytes counted
    once: a D2D copy reads and writes each)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    other = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(pinned, non_blocking=True)  # untimed: the copy engines' first use
    return {
        "h2d_pinned": spread(
            timed(lambda: dst.copy_(pinned, non_blocking=True), repeat, device), nbytes
        ),
        "h2d_pageable": spread(timed(lambda: dst.copy_(pageable), repeat, device), nbytes),
        "d2d": spread(timed(lambda: dst.copy_(other), repeat, device), nbytes),
        "copy_bytes": nbytes,
    }


def cached_fraction(files: Sequence[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore over a fresh mapping, which faults
    nothing in); None where mincore is not available."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        pages = -(-size // page)
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as m:
            addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return None
            resident += sum(b & 1 for b in vec)
        total += pages
    return resident / total if total else 0.0


def drop_and_check(files: Sequence[Path]) -> JSON:
    """posix_fadvise(DONTNEED) on every file, then how much stayed cached: a cold run after a
    drop that did not happen is a warm run, and the report says so."""
    drop_cache(list(files))
    left = cached_fraction(files)
    dropped = None if left is None else left < DROPPED_BELOW
    return {"dropped": dropped, "cached_after": None if left is None else round(left, 4)}


def host_limits(files: Sequence[Path], nbytes: int, repeat: int) -> JSON:
    """memcpy (all cores) and O_DIRECT reads of the files (cache dropped first), medians."""
    ncpu = os.cpu_count() or 1
    mem, direct = [], []
    for _ in range(repeat):
        mem.append(memcpy_gbps(min(nbytes, 1 << 30), max(2, ncpu)))
        drop_cache(list(files))
        od = odirect_read_gbps(list(files), max(2, ncpu))
        if od is not None:
            direct.append(od)
    return {
        "memcpy_gbps": round(statistics.median(mem), 3),
        "odirect_read_gbps": round(statistics.median(direct), 3) if direct else None,
        "odirect_note": None if direct else "O_DIRECT not supported by this filesystem",
        "threads": max(2, ncpu),
    }


def measure_limits(files: Sequence[Path], device: torch.device, repeat: int) -> JSON:
    nbytes = sum(f.stat().st_size for f in files)
    out = host_limits(files, nbytes, repeat)
    if device.type == "cuda":
        out.update(copy_limits(device, min(nbytes, 4 << 30), repeat))
        torch.cuda.empty_cache()  # the copies' buffers, before the loaders need the memory
    else:
        out["cuda"] = "no CUDA: host-to-device and device-to-device not measured"
    return out
