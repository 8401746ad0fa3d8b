"""Preload: every byte of one rank's safetensors files resident in host memory before serving.

Two paths behind `PreloadLoader.load_index`, chosen by the target device:

CPU target (`_load_mapped`): zero copy. The files are mapped MAP_PRIVATE, PROT_READ|PROT_WRITE
(what safetensors' `load_file` does through `UntypedStorage.from_file(shared=False)`: tensors are
writable, a write copies that one page and never reaches the file) back to back into one
reserved address range, so all tensors are views of one storage (one region for P2P). Then the
pages are faulted in up front, in parallel, with `madvise(MADV_POPULATE_READ)` (Linux 5.14+; a
read-only populate: no copy-on-write break, unlike MAP_POPULATE on a writable private mapping,
which copies every page into anonymous memory). On return every byte is resident and mapped:
serving takes no page faults (the data stays page cache, so a later memory squeeze may evict
clean pages; nothing here mlocks). Files are checked against their headers' sizes before
mapping, and a populate that would hit a SIGBUS (file shrank meanwhile) fails with EFAULT, which
becomes a LoadError naming the file. Kernels without MADV_POPULATE_READ touch one byte per page.

Where the time goes (CPU; `weightlift bench load --size-mb 256 --repeat 5`, 4 files, shared
2-core box, medians; the numbers swing about 2x with the neighbours' load):
 - warm cache (~15 ms for 260 MB, ~1x the box's threaded memcpy GB/s, 2x safetensors): no data
   moves; the time is the kernel walking the page cache and writing page-table entries. The
   mappings are advised MADV_HUGEPAGE so a cold load through them fills the page cache with
   2 MiB folios, and populating a range of large folios is ~3x faster than of 4 KiB pages
   (measured 47 vs 13 GB/s on 512 MB); the kernel still maps them with 4 KiB PTEs (no PMD
   mapping of a private file mapping here), so page-table writes are what is left. Header
   parsing and building ~100 views is < 1 ms. The peers pay 4 KiB faults lazily in the bench's
   per-page touch (safetensors, direct: mmap + fault-around) or a full copy into fresh memory
   (fastsafetensors, runai; and our own staged path: ~0.5-1 GB/s here, zeroing + copy).
 - cold cache (~2.3-2.5 GB/s, about 2x O_DIRECT reads and safetensors here): the storage. One
   populate job per file (more when a file is large next to total/threads), each a sequential
   stream, so mmap readahead issues 2-4 MiB reads; CPU time is the kernel's copy into the page
   cache. On a fast NVMe array more concurrent streams (`threads`) help; on this VM disk they
   do not.
 - not done: mlock (needs RLIMIT_MEMLOCK; page cache stays evictable under memory pressure) and
   PMD mappings (would need a read-only or shared mapping; safetensors' semantics are private
   and writable). The page cache is shared: ranks/pods on one node mapping the same files use
   one copy of host memory.

CUDA target (`_load_staged`): read big chunks (one fd per chunk, so each has its own readahead)
with a pool of reader threads into a ring of pinned staging buffers; as each read completes its
buffer is copied to one device buffer on a side stream (non_blocking), and an event tells when
the buffer is free again; so disk/page-cache reads and host->device copies overlap, and pinned
memory stays at (threads + 2) chunks however big the model. Tensors are views of the device
buffer. The same code runs on CPU (pageable staging, synchronous copies) so tests cover it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weightlift.worker.weights.files import ShardIndex, shard_index
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import (
    canonical_residue,
    file_residues,
    place,
    view_tensor,
)

if TYPE_CHECKING:
    from weightlift.api.worker import WorkerPlan

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # PMD size on x86-64 and arm64 (4 KiB pages)
_HUGEPAGE_ADVICE = True
_ALIGN = 4096
# Ranges a populate job handles at once (progress granularity); a multiple of 2 MiB.
_POPULATE_STEP = 64 << 20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; 22 in <asm/mman.h>


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ---------------------------------------------------------------------------------------------
# libc: mmap with MAP_FIXED (Python's mmap module cannot place a mapping) and madvise by address.


class _Libc:
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


_libc: _Libc | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value
# Set once a kernel answered EINVAL to MADV_POPULATE_READ (older than 5.14): touch pages instead.
_populate_unsupported = False


def _get_libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


class _Region:
    """One reserved address range holding every file's mapping; unmapped when the last tensor
    viewing it is gone (the buffer object below keeps this alive). The base is 2 MiB aligned
    and each file sits at an address congruent to its file offset mod 2 MiB, so the kernel can
    map the page cache's 2 MiB folios with one PMD entry each. The reservation itself is plain
    anonymous memory (never touched, so never backed) so the gaps are valid memory too: the
    whole region can be registered as one buffer (P2P)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.addr = 0
        self._raw = 0
        self._raw_len = nbytes + _HUGE
        self._lock = threading.Lock()
        libc = _get_libc()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        raw = libc.mmap(None, self._raw_len, prot, flags, -1, 0)
        if raw in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise LoadError(f"cannot reserve {nbytes} bytes of address space: {os.strerror(err)}")
        self._raw = int(raw)
        self.addr = _round_up(self._raw, _HUGE)

    def map_file(self, offset: int, length: int, fd: int, file_offset: int, path: str) -> None:
        libc = _get_libc()
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_PRIVATE | 0x10  # MAP_FIXED: replaces our own reservation only
        got = libc.mmap(self.addr + offset, length, prot, flags, fd, file_offset)
        if got in (None, _MAP_FAILED) or int(got) != self.addr + offset:
            err = ctypes.get_errno()
            raise LoadError(f"{path}: mmap failed: {os.strerror(err)}")
        # Cold reads through this mapping then fill the page cache with 2 MiB folios (mmap
        # readahead honours VM_HUGEPAGE): fewer, larger folios to map on every later load.
        # Advice only: a kernel without file THP says EINVAL and nothing changes.
        if _HUGEPAGE_ADVICE and hasattr(mmap, "MADV_HUGEPAGE"):
            libc.madvise(self.addr + offset, length, mmap.MADV_HUGEPAGE)

    def buffer(self) -> Any:
        arr = (ctypes.c_uint8 * self.nbytes).from_address(self.addr)
        arr._wl_region = self  # type: ignore[attr-defined]  # lifetime: tensors -> arr -> self
        return arr

    def close(self) -> None:
        with self._lock:
            if self._raw:
                _get_libc().munmap(self._raw, self._raw_len)
                self._raw = self.addr = 0

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class _Range:
    """A contiguous part of one file's mapping that one thread populates, in steps."""

    file_no: int
    region_offset: int
    length: int
    data_bytes: int  # bytes of the file's data section inside this range (for progress)


def _populate(region: _Region, rng: _Range, path: str, progress: LoadProgress) -> None:
    global _populate_unsupported
    libc = _get_libc()
    done = 0
    # Progress is counted in data bytes; spread the range's share over its steps.
    reported = 0
    while done < rng.length:
        n = min(_POPULATE_STEP, rng.length - done)
        addr = region.addr + rng.region_offset + done
        if not _populate_unsupported and libc.madvise(addr, n, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:
                _populate_unsupported = True
            elif err == errno.EFAULT:
                raise LoadError(
                    f"{path}: truncated while reading (file shrank below its header's size)"
                )
            elif err == errno.EINTR:
                continue
            else:
                raise LoadError(f"{path}: cannot read into memory: {os.strerror(err)}")
        if _populate_unsupported:  # old kernel: one read per page (numpy releases the GIL)
            libc.madvise(addr, n, mmap.MADV_WILLNEED)
            page = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
            int(page[::_PAGE].sum())
        done += n
        share = rng.data_bytes * done // rng.length
        progress.add(share - reported)
        reported = share


def _ranges(
    index: ShardIndex, offsets: list[int], spans: list[int], threads: int, step: int
) -> list[_Range]:
    """Split each file's mapping into at most a few contiguous ranges: one per file unless a
    file is large next to total/threads, so readahead sees long sequential streams."""
    total = sum(spans)
    piece = _round_up(max(step, -(-total // max(1, threads))), 2 << 20)
    out: list[_Range] = []
    for i, h in enumerate(index.files):
        span = spans[i]
        n = max(1, -(-span // piece))
        size = _round_up(-(-span // n), _PAGE)
        lead = h.data_start - h.data_start // _PAGE * _PAGE  # header bytes in the first page
        off = 0
        while off < span:
            length = min(size, span - off)
            # Data bytes in [off, off + length) of a mapping whose data starts at `lead`.
            lo, hi = max(off, lead), min(off + length, lead + h.data_bytes)
            out.append(_Range(i, offsets[i] + off, length, max(0, hi - lo)))
            off += length
    # Big ranges first; ties keep file order.
    out.sort(key=lambda r: -r.length)
    return out


@contextmanager
def _open_all(index: ShardIndex) -> Iterator[list[int]]:
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


def _views(
    index: ShardIndex, buf: torch.Tensor, data_offsets: list[int]
) -> dict[str, torch.Tensor]:
    """Every tensor as a view of `buf`, file i's data section starting at data_offsets[i]."""
    out: dict[str, torch.Tensor] = {}
    for i, h in enumerate(index.files):
        for name, info in h.tensors.items():
            out[name] = view_tensor(buf, data_offsets[i] + info.begin - h.data_start, info)
    return out


def _residues(index: ShardIndex, device: torch.device) -> dict[str, int]:
    return file_residues((info for _, info in index.tensors.values()), device)


def _load_mapped(
    index: ShardIndex, progress: LoadProgress, threads: int, chunk_bytes: int
) -> dict[str, torch.Tensor]:
    """CPU target: map every file into one region, populate it in parallel; tensors are views."""
    files = index.files
    # File i is mapped from the page holding its data start to its end, at offsets[i].
    first = [h.data_start // _PAGE * _PAGE for h in files]
    spans = [
        _round_up(h.file_size - f, _PAGE) if h.data_bytes else 0
        for h, f in zip(files, first, strict=True)
    ]
    offsets: list[int] = []
    total = 0
    for f, span in zip(first, spans, strict=True):
        if span:  # address = file offset (mod 2 MiB): huge page-cache folios map as PMDs
            total += (f - total) % _HUGE
        offsets.append(total)
        total += span
    if total == 0:
        out = _views(index, torch.empty(0, dtype=torch.uint8), [0] * len(files))
        progress.finish()
        return out
    region = _Region(total)
    try:
        with _open_all(index) as fds:
            for i, h in enumerate(files):
                if spans[i]:
                    # Readahead state lives in the open file, which the mapping keeps.
                    os.posix_fadvise(fds[i], first[i], 0, os.POSIX_FADV_SEQUENTIAL)
                    region.map_file(offsets[i], spans[i], fds[i], first[i], h.path)
        ranges = _ranges(index, offsets, spans, threads, max(chunk_bytes, _POPULATE_STEP))
        workers = max(1, min(threads, len(ranges)))
        with ThreadPoolExecutor(workers, thread_name_prefix="wl-preload") as pool:
            futs = [
                pool.submit(_populate, region, r, files[r.file_no].path, progress) for r in ranges
            ]
            try:
                for fut in futs:
                    fut.result()
            except BaseException:
                for fut in futs:
                    fut.cancel()
                raise
        host = torch.frombuffer(region.buffer(), dtype=torch.uint8)
    except BaseException:
        region.close()
        raise
    data_offsets = [offsets[i] + h.data_start - first[i] for i, h in enumerate(files)]
    # Every address is its file offset mod 2 MiB: each tensor already sits at its canonical
    # residue (weights/tensors.py), so `place` copies nothing; it only guards the rule.
    out, _ = place(_views(index, host, data_offsets), _residues(index, torch.device("cpu")))
    progress.finish()
    return out


# ---------------------------------------------------------------------------------------------
# CUDA target: read into a ring of pinned staging buffers, copy each to the device as it lands.


@dataclass(frozen=True)
class _Chunk:
    file_no: int
    file_offset: int
    buf_offset: int
    length: int


def _read_chunk(path: str, view: memoryview, file_offset: int) -> int:
    # One fd per chunk: readahead state lives in the open file, and concurrent streams at
    # different offsets of one fd look random to the kernel (cold reads shrink to single pages).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise LoadError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        os.posix_fadvise(fd, file_offset, len(view), os.POSIX_FADV_SEQUENTIAL)
        done = 0
        n = len(view)
        while done < n:
            try:
                got = os.preadv(fd, [view[done:]], file_offset + done)
            except OSError as exc:
                at = file_offset + done
                raise LoadError(f"{path}: read failed at offset {at}: {exc}") from None
            if got == 0:
                at = file_offset + done
                raise LoadError(f"{path}: truncated while reading (file shrank at offset {at})")
            done += got
    finally:
        os.close(fd)
    return n


def _load_staged(
    index: ShardIndex,
    device: torch.device,
    progress: LoadProgress,
    threads: int,
    chunk_bytes: int,
    pinned: bool,
) -> dict[str, torch.Tensor]:
    cuda = device.type == "cuda"
    files = index.files
    # File i's data lands at bases[i]: a page boundary plus its canonical residue, so on the
    # host every tensor sits where a mapping would put it (mod 64) and nothing is copied again.
    bases: list[int] = []
    total = 0
    for h in files:
        bases.append(_round_up(total, _ALIGN) + canonical_residue(device, h.data_start, 1))
        total = bases[-1] + h.data_bytes
    chunks: list[_Chunk] = []
    for i, h in enumerate(files):
        off = 0
        while off < h.data_bytes:
            n = min(chunk_bytes, h.data_bytes - off)
            chunks.append(_Chunk(i, h.data_start + off, bases[i] + off, n))
            off += n
    # Interleave files so several stream at once.
    chunks.sort(key=lambda c: (c.file_offset, c.file_no))
    dev_buf = torch.empty(total, dtype=torch.uint8, device=device)
    threads = max(1, min(threads, len(chunks) or 1))
    slot_bytes = max((c.length for c in chunks), default=0)
    nslots = min(len(chunks), threads + 2)
    pin = cuda and pinned and torch.cuda.is_available()
    slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(nslots)]
    views = [memoryview(s.numpy()) for s in slots]  # type: ignore[arg-type]
    stream = torch.cuda.Stream(device) if cuda else None
    events: list[Any] = [None] * nslots
    if stream is not None:  # dev_buf was allocated on the current stream: order after it
        stream.wait_stream(torch.cuda.current_stream(device))
    free = deque(range(nslots))  # FIFO: the oldest freed slot's copy is likeliest done
    with _open_all(index), ThreadPoolExecutor(threads, thread_name_prefix="wl-preload") as pool:

        def work(c: _Chunk, slot: int) -> tuple[_Chunk, int]:
            _read_chunk(files[c.file_no].path, views[slot][: c.length], c.file_offset)
            return c, slot

        todo = iter(chunks)
        pending: set[Future[tuple[_Chunk, int]]] = set()
        try:
            while True:
                while free:
                    c = next(todo, None)
                    if c is None:
                        break
                    slot = free.popleft()
                    if events[slot] is not None:  # its last H2D copy must be done first
                        events[slot].synchronize()
                    pending.add(pool.submit(work, c, slot))
                if not pending:
                    break
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    c, slot = fut.result()
                    dst = dev_buf[c.buf_offset : c.buf_offset + c.length]
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            dst.copy_(slots[slot][: c.length], non_blocking=True)
                            events[slot] = torch.cuda.Event()
                            events[slot].record(stream)
                    else:
                        dst.copy_(slots[slot][: c.length])
                    progress.add(c.length)
                    free.append(slot)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    if stream is not None:
        stream.synchronize()
    # On CUDA tensors off a 64-byte boundary are copied once more on the device (the rule there).
    out, _ = place(_views(index, dev_buf, bases), _residues(index, device))
    progress.finish()
    return out


class PreloadLoader:
    """Loader "preload"; `threads`, `chunk_mib`, `pinned` default to the plan's preload options.

    `staged=True` forces the read-into-staging-buffers path on CPU too (tests, comparisons)."""

    name = "preload"

    def __init__(
        self,
        threads: int | None = None,
        chunk_mib: int | None = None,
        pinned: bool | None = None,
        *,
        staged: bool = False,
    ) -> None:
        self.threads = threads
        self.chunk_mib = chunk_mib
        self.pinned = pinned
        self.staged = staged

    def load(
        self, plan: WorkerPlan, rank: int, device: torch.device, progress: LoadProgress
    ) -> dict[str, torch.Tensor]:
        opts = plan.loading.preload
        index = shard_index(plan.model_dir, rank, plan.tensor_parallel)
        return self.load_index(
            index,
            device,
            progress,
            threads=self.threads or opts.threads,
            chunk_bytes=(self.chunk_mib or opts.chunk_mib) << 20,
            pinned=opts.pinned if self.pinned is None else self.pinned,
        )

    def load_index(
        self,
        index: ShardIndex,
        device: torch.device,
        progress: LoadProgress,
        *,
        threads: int = 8,
        chunk_bytes: int = 64 << 20,
        pinned: bool = True,
    ) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        progress.set_total(index.data_bytes)
        if device.type == "cpu" and not self.staged and sys.platform != "win32":
            return _load_mapped(index, progress, max(1, threads), chunk_bytes)
        return _load_staged(index, device, progress, max(1, threads), chunk_bytes, pinned)
