"""Checksum speed where the bytes are: GB/s of each kind `manifest.checksum` knows, on a tensor
on the device. The device kind ("dev64", computed by a kernel on CUDA) must give on CUDA exactly
what its CPU implementation gives, so a CPU replica and a GPU replica agree; the check runs on
several sizes and offsets, not one. A kind this build does not know is reported, not failed."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch

from weightlift.bench.gpu_limits import JSON, spread, timed
from weightlift.worker.p2p import manifest

KINDS = ("xxh3", "crc32", "dev64")
DEVICE_KIND = "dev64"
# Kinds that go through host memory on a CUDA tensor: slow there by design, timed on less.
HOST_KINDS = {"xxh3", "crc32"}
Checksum = Callable[[torch.Tensor, str], str]


def _checksum() -> Checksum:
    # Typed loosely on purpose: the kinds differ between builds (dev64 comes with devsum).
    return cast(Checksum, cast(Any, manifest).checksum)


def known(kind: str) -> bool:
    """Whether this build's `checksum` knows `kind` (it raises ValueError for one it does not)."""
    try:
        _checksum()(torch.zeros(8, dtype=torch.uint8), kind)
    except ValueError:
        return False
    return True


def agreement(device: torch.device, seed: int = 0) -> JSON:
    """The device's result equals the CPU's, bit for bit, across sizes and unaligned starts."""
    checksum = _checksum()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, ((64 << 20) + 4099,), dtype=torch.uint8, generator=gen)
    on_device = data.to(device)
    cases = [(0, 0), (0, 1), (1, 7), (3, 4096 + 5), (0, 1 << 20), (17, (64 << 20) - 3)]
    cases.append((0, data.numel()))
    mismatches = []
    for start, n in cases:
        cpu = checksum(data[start : start + n], DEVICE_KIND)
        dev = checksum(on_device[start : start + n], DEVICE_KIND)
        if cpu != dev:
            mismatches.append({"offset": start, "bytes": n, "cpu": cpu, "device": dev})
    return {"cases": len(cases), "equal": not mismatches, "mismatches": mismatches}


def run_checksums(device: torch.device, nbytes: int, repeat: int) -> JSON:
    checksum = _checksum()
    out: JSON = {"device": str(device), "kinds": {}}
    big = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    host_bytes = min(nbytes, 512 << 20) if device.type == "cuda" else nbytes
    sync = device if device.type == "cuda" else None
    for kind in KINDS:
        if not known(kind):
            out["kinds"][kind] = {"skipped": f"{kind} not available"}
            continue
        t = big if kind not in HOST_KINDS else big[:host_bytes]
        try:
            checksum(t[: 1 << 20], kind)  # untimed: kernel compile, staging buffers
            out["kinds"][kind] = spread(timed(partial(checksum, t, kind), repeat, sync), t.numel())
        except Exception as exc:  # one kind failing on this device is its result
            out["kinds"][kind] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if known(DEVICE_KIND) and device.type == "cuda":
        try:
            out["agreement"] = agreement(device)
        except Exception as exc:
            out["agreement"] = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    elif known(DEVICE_KIND):
        out["agreement"] = {"note": "CPU only: the device kernel was not run"}
    del big
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
