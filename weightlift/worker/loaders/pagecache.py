"""File access for the staged preload: is a range in the page cache (mincore), and read a
chunk into an aligned slot, with O_DIRECT where the range is cold (the disk's full speed, no
copy through the page cache) or buffered where it is warm or O_DIRECT is refused (tmpfs, some
overlayfs; the filesystem answers EINVAL at open or at the first read)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from weightlift.worker.loaders.layout import IO_ALIGN, Chunk, round_up
from weightlift.worker.loaders.libc import MAP_FAILED, get_libc
from weightlift.worker.weights.progress import LoadError

if TYPE_CHECKING:
    from weightlift.worker.weights.files import ShardIndex

O_DIRECT = getattr(os, "O_DIRECT", 0)
_PAGE = mmap.PAGESIZE


@contextmanager
def open_all(index: ShardIndex) -> Iterator[list[int]]:
    """Open every file, failing fast (naming the file) before any work starts; check each is
    still as long as its header says (mapping past EOF would SIGBUS at first touch)."""
    fds: list[int] = []
    try:
        for h in index.files:
            try:
                fd = os.open(h.path, os.O_RDONLY)
            except OSError as exc:
                raise LoadError(f"{h.path}: cannot open: {exc.strerror or exc}") from None
            fds.append(fd)
            size = os.fstat(fd).st_size
            if size < h.file_size:
                raise LoadError(
                    f"{h.path}: truncated while reading (file is {size} bytes, its header "
                    f"needs {h.file_size})"
                )
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def resident_fraction(fd: int, start: int, length: int) -> float:
    """Share of the pages of file bytes [start, start + length) in the page cache (mincore on a
    read-only mapping; nothing is faulted in). 1.0 where it cannot tell (then reads stay
    buffered, the safe choice)."""
    if length <= 0:
        return 1.0
    lo = start // _PAGE * _PAGE
    n = round_up(start + length, _PAGE) - lo
    libc = get_libc()
    addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr in (None, MAP_FAILED):
        return 1.0
    try:
        pages = n // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, n, vec) != 0:
            return 1.0
        return int((np.ctypeslib.as_array(vec) & 1).sum()) / pages
    finally:
        libc.munmap(addr, n)


def _open(path: str, direct: bool) -> int:
    flags = os.O_RDONLY | (O_DIRECT if direct else 0)
    try:
        return os.open(path, flags)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            return -1  # the filesystem refuses O_DIRECT: read through the page cache
        raise LoadError(f"{path}: cannot open: {exc.strerror or exc}") from None


def read_chunk(path: str, view: memoryview, chunk: Chunk, *, direct: bool) -> bool:
    """File bytes [chunk.start, chunk.data_hi) into `view` (at least chunk.read_len long and
    IO_ALIGN-aligned for O_DIRECT). Returns whether O_DIRECT did the reading. Raises LoadError
    naming the file when it cannot be read or is shorter than its header says."""
    need = chunk.data_hi - chunk.start
    fd = _open(path, direct) if direct and O_DIRECT else -1
    used_direct = fd >= 0
    if fd < 0:
        fd = _open(path, False)
        # One fd per chunk: readahead state lives in the open file, and concurrent streams at
        # different offsets of one fd look random to the kernel.
        os.posix_fadvise(fd, chunk.start, need, os.POSIX_FADV_SEQUENTIAL)
    try:
        done = 0
        while done < need:
            # O_DIRECT reads whole aligned blocks (the file's tail block comes back short).
            end = chunk.read_len if used_direct else need
            try:
                got = os.preadv(fd, [view[done:end]], chunk.start + done)
            except OSError as exc:
                if used_direct and exc.errno == errno.EINVAL:
                    os.close(fd)
                    fd, used_direct = -1, False
                    fd = _open(path, False)
                    continue
                at = chunk.start + done
                raise LoadError(f"{path}: read failed at offset {at}: {exc}") from None
            if got == 0:
                at = chunk.start + done
                raise LoadError(f"{path}: truncated while reading (file shrank at offset {at})")
            done += got
            if used_direct and done < need and done % IO_ALIGN:  # short read mid-block
                os.close(fd)
                fd, used_direct = -1, False
                fd = _open(path, False)
    finally:
        if fd >= 0:
            os.close(fd)
    return used_direct


def direct_io_supported(path: str) -> bool:
    """Whether the filesystem holding `path` accepts an O_DIRECT open and aligned read."""
    if not O_DIRECT:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, IO_ALIGN)
        try:
            os.preadv(fd, [buf], 0)
        except OSError:
            return False
        finally:
            buf.close()
        return True
    finally:
        os.close(fd)
