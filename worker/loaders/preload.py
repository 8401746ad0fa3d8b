"""Preload: whole safetensors files read in parallel into one host buffer, tensors as views.

Where the time goes (CPU target): the parallel `preadv` calls copy from the page cache (warm) or
the disk (cold) into the buffer; the first touch of each fresh page costs a page fault inside
the kernel's copy, so the buffer is an anonymous mapping advised for transparent huge pages
(2 MiB faults instead of 4 KiB ones). No per-tensor I/O, no per-tensor allocation: tensors are
`view`s of the buffer (one copy only for a tensor whose offset is not aligned to its dtype).
CUDA target: the buffer is pinned, and every chunk is copied to one device buffer on a side
stream as soon as its read completes, so disk reads and H2D copies overlap.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weightlift.worker.loaders.base import LoadError, LoadProgress
from weightlift.worker.loaders.files import ShardIndex, shard_index
from weightlift.worker.loaders.tensors import view_tensor

if TYPE_CHECKING:
    from weightlift.worker.plan import WorkerPlan

_ALIGN = 4096


@dataclass(frozen=True)
class _Chunk:
    file_no: int
    file_offset: int
    buf_offset: int
    length: int


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A flat uint8 host buffer; pinned for CUDA, else anonymous memory advised for huge pages."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):  # THP disabled: plain pages
            mm.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps `mm` alive as long as the tensor (and every view of it) lives.
    return torch.frombuffer(mm, dtype=torch.uint8)


@contextmanager
def _open_all(paths: list[str]) -> Iterator[list[int]]:
    fds: list[int] = []
    try:
        for p in paths:
            try:
                fds.append(os.open(p, os.O_RDONLY))
            except OSError as exc:
                raise LoadError(f"{p}: cannot open: {exc.strerror or exc}") from None
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def _read_chunk(fd: int, path: str, view: memoryview, file_offset: int) -> int:
    done = 0
    n = len(view)
    while done < n:
        try:
            got = os.preadv(fd, [view[done:]], file_offset + done)
        except OSError as exc:
            raise LoadError(f"{path}: read failed at offset {file_offset + done}: {exc}") from None
        if got == 0:
            at = file_offset + done
            raise LoadError(f"{path}: truncated while reading (file shrank at offset {at})")
        done += got
    return n


class PreloadLoader:
    """Loader "preload"; `threads`, `chunk_mib`, `pinned` default to the plan's preload options."""

    name = "preload"

    def __init__(
        self, threads: int | None = None, chunk_mib: int | None = None, pinned: bool | None = None
    ) -> None:
        self.threads = threads
        self.chunk_mib = chunk_mib
        self.pinned = pinned

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
        cuda = device.type == "cuda"
        # Layout: each file's data section at a 4 KiB-aligned base in one buffer.
        bases: list[int] = []
        total = 0
        for h in index.files:
            bases.append(total)
            total += -(-h.data_bytes // _ALIGN) * _ALIGN
        progress.set_total(index.data_bytes)
        host = _host_buffer(total, pinned=cuda and pinned and torch.cuda.is_available())
        chunks: list[_Chunk] = []
        for i, h in enumerate(index.files):
            off = 0
            while off < h.data_bytes:
                n = min(chunk_bytes, h.data_bytes - off)
                chunks.append(_Chunk(i, h.data_start + off, bases[i] + off, n))
                off += n
        # Interleave files so that several files stream at once, big chunks first.
        chunks.sort(key=lambda c: (c.file_offset, c.file_no))
        dev_buf = torch.empty(total, dtype=torch.uint8, device=device) if cuda else host
        mv = memoryview(host.numpy()) if total else memoryview(b"")  # type: ignore[arg-type]
        paths = [h.path for h in index.files]
        stream = torch.cuda.Stream(device) if cuda else None
        # _open_all fails fast (naming the file) before any thread starts.
        with _open_all(paths), ThreadPoolExecutor(max(1, threads)) as pool:

            def work(c: _Chunk) -> _Chunk:
                # One fd per chunk: readahead state lives in the open file, and concurrent
                # streams at different offsets of one fd look random to the kernel (cold-cache
                # reads then shrink to single pages).
                fd = os.open(paths[c.file_no], os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, c.file_offset, c.length, os.POSIX_FADV_SEQUENTIAL)
                    _read_chunk(
                        fd,
                        paths[c.file_no],
                        mv[c.buf_offset : c.buf_offset + c.length],
                        c.file_offset,
                    )
                finally:
                    os.close(fd)
                progress.add(c.length)
                return c

            pending: set[Future[_Chunk]] = {pool.submit(work, c) for c in chunks}
            try:
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        c = fut.result()
                        if stream is not None:
                            with torch.cuda.stream(stream):
                                a, b = c.buf_offset, c.buf_offset + c.length
                                dev_buf[a:b].copy_(host[a:b], non_blocking=True)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        if stream is not None:
            stream.synchronize()
        out: dict[str, torch.Tensor] = {}
        for i, h in enumerate(index.files):
            for name, info in h.tensors.items():
                out[name] = view_tensor(dev_buf, bases[i] + info.begin - h.data_start, info)
        progress.finish()
        return out
