"""libc calls Python's mmap module lacks: mmap at a chosen address (MAP_FIXED), madvise and
mincore by address. Loaded once per process."""

from __future__ import annotations

import ctypes
import ctypes.util

MAP_FAILED = ctypes.c_void_p(-1).value


class Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self.munmap = lib.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = lib.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mincore = lib.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


_libc: Libc | None = None


def get_libc() -> Libc:
    global _libc
    if _libc is None:
        _libc = Libc()
    return _libc
