"""Preload's staged path (every CUDA target; CPU on request): chunks of the files reach one
target buffer through the process's staging pool (staging.py), by way of a copy engine
(copyengine.py), with reads and copies overlapping.

Per chunk a reader thread (as many as the pod's CPUs, podlimits.py) either
 - warm, CUDA: registers the chunk's window of a read-only mapping of the file, so the copy's
   source is the page cache itself (registered.py: no CPU copy), or
 - reads it into a leased slot: O_DIRECT where the chunk is not in the page cache (the disk's
   speed, no page-cache copy), buffered where it is or where O_DIRECT is refused (pagecache.py).
The main thread queues the chunk's copies into the buffer (one per layout segment it feeds,
layout.py) and records a ticket; a slot is reused, and a window unregistered, only once its
ticket is done. On any failure the readers still running finish, then every queued copy is
waited for, and only then are windows unregistered and slots given back to the pool: nothing
frees memory a DMA may still read.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from weightlift.worker.loaders import layout, registered
from weightlift.worker.loaders.copyengine import CopyEngine, copy_engine_for
from weightlift.worker.loaders.layout import IO_ALIGN, Chunk, round_down
from weightlift.worker.loaders.pagecache import open_all, read_chunk, resident_fraction
from weightlift.worker.loaders.staging import StagingPool, staging_pool
from weightlift.worker.weights.files import ShardIndex
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import canonical_residue, file_residues, place, view_tensor

log = logging.getLogger(__name__)

DirectIO = Literal["auto", "always", "never"]
# A chunk at least this much in the page cache is warm (registered or buffered); at most
# COLD, cold (O_DIRECT); between, buffered (the cached part is not read from disk again).
WARM = 0.9
COLD = 0.1


@dataclass(frozen=True)
class _Fetched:
    chunk: Chunk
    slot: int
    host: torch.Tensor  # the chunk's bytes from chunk.start
    window: int | None  # a registered address to unregister once its copies are done
    direct: bool


@dataclass
class StagedStats:
    """How the chunks of the last load arrived (benchmarks print it)."""

    registered: int = 0
    direct: int = 0
    buffered: int = 0


def load_staged(
    index: ShardIndex,
    device: torch.device,
    progress: LoadProgress,
    *,
    threads: int,
    chunk_bytes: int,
    pinned: bool,
    pool: StagingPool | None = None,
    copy_engine: Callable[[torch.device], CopyEngine] = copy_engine_for,
    register: bool = True,
    direct_io: DirectIO = "auto",
    stats: StagedStats | None = None,
) -> dict[str, torch.Tensor]:
    files = index.files
    stats = stats if stats is not None else StagedStats()
    plan = layout.segments(files, lambda off, size: canonical_residue(device, off, size))
    segs: dict[int, list[layout.Segment]] = {}
    for s in plan.segments:
        segs.setdefault(s.file_no, []).append(s)
    pin = device.type == "cuda" and pinned and torch.cuda.is_available()
    pool = pool or staging_pool(pinned=pin)
    step = min(max(IO_ALIGN, round_down(chunk_bytes, IO_ALIGN)), pool.slot_bytes)
    todo = [
        c
        for i, h in enumerate(files)
        if h.data_bytes
        for c in layout.chunks(i, h.data_start, h.file_size, step)
    ]
    todo.sort(key=lambda c: (c.start, c.file_no))  # interleave files: several stream at once
    dev_buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    use_register = register and registered.registration_allowed(device)
    threads = max(1, min(threads, len(todo) or 1))
    engine = copy_engine(device)
    # A device with an index is current while its streams and events are made and waited on.
    on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    try:
        with (
            on_device,
            open_all(index) as fds,
            pool.lease(min(len(todo), threads + 2) or 1) as slots,
        ):
            maps = _map_files(index, fds) if use_register else {}
            views = {s: memoryview(pool.slots[s].numpy()) for s in slots}  # type: ignore[arg-type]

            def fetch(c: Chunk, slot: int) -> _Fetched:
                path, fd = files[c.file_no].path, fds[c.file_no]
                warmth = resident_fraction(fd, c.start, c.read_len) if direct_io == "auto" else 1
                m = maps.get(c.file_no)
                if m is not None and warmth >= WARM and registered.registration_allowed(device):
                    n = min(c.read_len, m.length - c.start)
                    if registered.register(m.addr + c.start, n):
                        return _Fetched(c, slot, m.window(c.start, n), m.addr + c.start, False)
                cold = direct_io == "always" or warmth <= COLD
                used = read_chunk(path, views[slot], c, direct=cold and direct_io != "never")
                if pin:
                    pool.pin(slot)  # once per slot and process (a prepared pool is pinned)
                return _Fetched(c, slot, pool.slots[slot], None, used)

            _run(fetch, todo, slots, threads, engine, dev_buf, segs, progress, stats, maps)
    finally:
        engine.close()
    out = {
        name: view_tensor(dev_buf, plan.offsets[name], info)
        for name, (_, info) in index.tensors.items()
    }
    # The layout put every tensor at its canonical residue: `place` copies nothing, it guards.
    out, _ = place(out, file_residues((info for _, info in index.tensors.values()), device))
    progress.finish()
    return out


def _map_files(index: ShardIndex, fds: list[int]) -> dict[int, registered.FileMapping]:
    """Read-only mappings of the files to register windows of; a file that cannot be mapped
    is read into slots instead."""
    maps: dict[int, registered.FileMapping] = {}
    for i, h in enumerate(index.files):
        if h.data_bytes:
            try:
                maps[i] = registered.FileMapping(fds[i], h.file_size, h.path)
            except LoadError as exc:
                log.info("%s; reading it into staging slots", exc)
    return maps


def _run(
    fetch: Callable[[Chunk, int], _Fetched],
    todo: list[Chunk],
    slots: list[int],
    threads: int,
    engine: CopyEngine,
    dev_buf: torch.Tensor,
    segs: dict[int, list[layout.Segment]],
    progress: LoadProgress,
    stats: StagedStats,
    maps: dict[int, registered.FileMapping],
) -> None:
    """Read every chunk and queue its copies; on return (or raise) no copy is queued, no
    reader runs and no window is registered."""
    free = deque(slots)  # FIFO: the oldest freed slot's copy is likeliest done
    tickets: dict[int, Any] = {}
    windows: dict[int, int] = {}  # slot -> registered address its last copies read
    submitted: list[Future[_Fetched]] = []
    consumed: set[int] = set()
    chunks = iter(todo)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="wl-preload") as readers:
            pending: set[Future[_Fetched]] = set()
            try:
                while True:
                    while free:
                        c = next(chunks, None)
                        if c is None:
                            break
                        slot = free.popleft()
                        _settle(engine, slot, tickets, windows)
                        fut = readers.submit(fetch, c, slot)
                        submitted.append(fut)
                        pending.add(fut)
                    if not pending:
                        break
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        got = fut.result()
                        consumed.add(id(fut))
                        for cp in layout.copies(got.chunk, segs.get(got.chunk.file_no, [])):
                            dst = dev_buf[cp.dst_offset : cp.dst_offset + cp.length]
                            engine.copy(dst, got.host[cp.src_offset : cp.src_offset + cp.length])
                        tickets[got.slot] = engine.record()
                        if got.window is not None:
                            windows[got.slot] = got.window
                            stats.registered += 1
                        elif got.direct:
                            stats.direct += 1
                        else:
                            stats.buffered += 1
                        progress.add(got.chunk.data_bytes)
                        free.append(got.slot)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        # Leaving the executor waited for every running reader.
    finally:
        try:
            engine.synchronize()  # every queued copy done before a slot or window goes
        finally:
            for addr in windows.values():
                registered.unregister(addr)
            for fut in submitted:  # a window a reader registered that was never copied
                if id(fut) in consumed or not fut.done() or fut.cancelled():
                    continue
                if fut.exception() is None and (w := fut.result().window) is not None:
                    registered.unregister(w)
            for m in maps.values():
                m.close()


def _settle(
    engine: CopyEngine, slot: int, tickets: dict[int, Any], windows: dict[int, int]
) -> None:
    """Before a slot is reused: its last copies done, the window they read unregistered."""
    ticket = tickets.pop(slot, None)
    if ticket is not None:
        engine.wait(ticket)
    addr = windows.pop(slot, None)
    if addr is not None:
        registered.unregister(addr)
