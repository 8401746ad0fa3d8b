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

CUDA target (staged.py): chunks read by as many threads as the pod has CPUs into slots of the
process's staging pool (staging.py: pinned, allocated once, early), or, warm, registered
page-cache windows with no CPU copy (registered.py); cold chunks are read with O_DIRECT
(pagecache.py). Each chunk is copied to one device buffer on a side stream as it lands (a copy
engine, copyengine.py), so reads and host->device copies overlap; a slot is reused only when its
copy is done, and a failed load waits for every queued copy before any slot goes back. Tensors
are views of the device buffer, each at its canonical placement (layout.py), none held twice.
The same code runs on CPU (pageable slots, synchronous copies) so tests cover it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weightlift.worker.loaders.copyengine import CopyEngine, copy_engine_for
from weightlift.worker.loaders.libc import MAP_FAILED
from weightlift.worker.loaders.libc import get_libc as _get_libc
from weightlift.worker.loaders.pagecache import open_all as _open_all
from weightlift.worker.loaders.podlimits import reader_threads
from weightlift.worker.loaders.staged import DirectIO, StagedStats, load_staged
from weightlift.worker.loaders.staging import StagingPool
from weightlift.worker.weights.files import ShardIndex, shard_index
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import (
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


# libc: mmap with MAP_FIXED (Python's mmap module cannot place a mapping) and madvise by address.
_MAP_FAILED = MAP_FAILED
# Set once a kernel answered EINVAL to MADV_POPULATE_READ (older than 5.14): touch pages instead.
_populate_unsupported = False


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


class PreloadLoader:
    """Loader "preload"; `threads`, `chunk_mib`, `pinned` default to the plan's preload options
    (threads unset: the pod's CPU limit, podlimits.reader_threads).

    `staged=True` forces the staged path on CPU too (tests, comparisons). `pool`,
    `copy_engine`, `register` and `direct_io` tune the staged path (staged.py): the staging
    pool (default: the process's), how copies are queued and waited for, whether warm chunks
    are registered page-cache windows (CUDA only), and O_DIRECT ("auto": for chunks not in the
    page cache). `stats` counts how the last staged load's chunks arrived."""

    name = "preload"

    def __init__(
        self,
        threads: int | None = None,
        chunk_mib: int | None = None,
        pinned: bool | None = None,
        *,
        staged: bool = False,
        pool: StagingPool | None = None,
        copy_engine: Callable[[torch.device], CopyEngine] = copy_engine_for,
        register: bool = True,
        direct_io: DirectIO = "auto",
    ) -> None:
        self.threads = threads
        self.chunk_mib = chunk_mib
        self.pinned = pinned
        self.staged = staged
        self.pool = pool
        self.copy_engine = copy_engine
        self.register = register
        self.direct_io: DirectIO = direct_io
        self.stats = StagedStats()

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
        device: torch.device | str,
        progress: LoadProgress | None = None,
        *,
        threads: int | None = None,
        chunk_bytes: int = 64 << 20,
        pinned: bool = True,
    ) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        progress = progress if progress is not None else LoadProgress()
        progress.set_total(index.data_bytes)
        readers = max(1, threads or reader_threads())
        if device.type == "cpu" and not self.staged and sys.platform != "win32":
            return _load_mapped(index, progress, readers, chunk_bytes)
        self.stats = StagedStats()
        return load_staged(
            index,
            device,
            progress,
            threads=readers,
            chunk_bytes=chunk_bytes,
            pinned=pinned,
            pool=self.pool,
            copy_engine=self.copy_engine,
            register=self.register,
            direct_io=self.direct_io,
            stats=self.stats,
        )
