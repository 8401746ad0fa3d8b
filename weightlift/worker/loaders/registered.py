"""Warm preload onto CUDA without the CPU copy: the page cache itself is the DMA source.

A file whose pages are cached is mapped read-only and each chunk's window of the mapping is
page-locked with `cudaHostRegister(Portable | ReadOnly)` (the pages are the page cache's, so
nothing is copied on the host), copied to the device by DMA, and unregistered once that copy is
done. On the H200 the staged path spent its time in the CPU copy into pinned slots (0.43x the
pinned host->device limit); this path skips that copy. Where registration is refused (no
ReadOnly support, a filesystem that cannot pin its pages, a locked-memory limit) the first
refusal turns it off for the process and the chunk is read into a staging slot instead.
Never attempted on CPU targets.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import torch

from weightlift.worker.loaders.layout import round_up
from weightlift.worker.loaders.libc import MAP_FAILED, get_libc
from weightlift.worker.weights.progress import LoadError

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_READ_ONLY = 8
REGISTER_FLAGS = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_READ_ONLY
DISABLE_ENV = "WEIGHTLIFT_PRELOAD_REGISTER"  # "0": never register (compare the staged path)

_refused: str | None = None  # why registration is off for this process
_lock = threading.Lock()


def registration_allowed(device: torch.device) -> bool:
    """Only for CUDA targets, with CUDA up, unless turned off or refused before."""
    return (
        device.type == "cuda"
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and _refused is None
        and torch.cuda.is_available()
    )


class FileMapping:
    """A whole file mapped read-only and shared (page-cache pages, never copied)."""

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.length = round_up(max(size, 1), mmap.PAGESIZE)
        addr = get_libc().mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise LoadError(f"{path}: mmap failed: {os.strerror(err)}")
        self.addr = int(addr)

    def window(self, offset: int, length: int) -> torch.Tensor:
        """Bytes [offset, offset + length) of the mapping as a uint8 tensor (no copy)."""
        raw = (ctypes.c_uint8 * length).from_address(self.addr + offset)
        return torch.frombuffer(raw, dtype=torch.uint8)

    def close(self) -> None:
        if self.addr:
            get_libc().munmap(self.addr, self.length)
            self.addr = 0


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error as the thread's last error, which torch's next
    kernel-launch check would report as its own: clear it (cudaGetLastError resets it)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libcudart.so" in path:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(path).cudaGetLastError()
            return


def host_register(addr: int, length: int, flags: int) -> str | None:
    """cudaHostRegister; None when done, else the driver's reason (its error cleared)."""
    cudart: Any = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(addr, length, flags)
    if int(rc) == 0:
        return None
    _clear_cuda_error()
    return str(cudart.cudaGetErrorString(rc))


def register(addr: int, length: int) -> bool:
    """Page-lock the page-cache window [addr, addr + length) for DMA, read-only; False (and off
    for the process) when the driver refuses."""
    global _refused
    why = host_register(addr, length, REGISTER_FLAGS)
    if why is None:
        return True
    with _lock:
        if _refused is None:
            _refused = f"cudaHostRegister: {why}"
            log.warning("registering page-cache windows refused (%s); staging instead", _refused)
    return False


def unregister(addr: int) -> None:
    cudart: Any = torch.cuda.cudart()
    if int(cudart.cudaHostUnregister(addr)) != 0:
        _clear_cuda_error()
