"""The staging pool: host buffers the staged preload reads into, allocated once per process.

On the H200 (../shared/notes/gpu-h200.md) pinned slots allocated on every load cost a fresh
process most of its first load; here they are allocated once, early (the worker allocates and
pins it while the init hooks run, `prepare_staging`), and every load leases slots from it.
Pinned (page-locked, so host->device copies are async DMA) for CUDA targets; pageable on CPU,
so the same logic runs in tests. Slots are 4 KiB aligned: O_DIRECT reads land in them directly.

Size: (readers + 2) slots of one chunk per local rank, capped at 1/16 of the pod's memory limit
(cgroup memory.max) and at MAX_POOL_BYTES; the host-memory check (`host_bytes_needed`) counts
it. Loads running at once (one per local rank) share it: each leases at least two slots.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weightlift.worker.loaders import podlimits, registered
from weightlift.worker.loaders.layout import IO_ALIGN, round_down

if TYPE_CHECKING:
    from weightlift.api.worker import WorkerPlan

log = logging.getLogger(__name__)

MAX_POOL_BYTES = 4 << 30
MIN_SLOT_BYTES = 1 << 20
POOL_SHARE = 16  # the pool takes at most 1/POOL_SHARE of the pod's memory limit
DEFAULT_CHUNK = 64 << 20


@dataclass(frozen=True)
class Geometry:
    slots: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


def pool_geometry(memory_limit: int, readers: int, chunk_bytes: int, ranks: int = 1) -> Geometry:
    """Slots and slot size for `ranks` loads of `readers` threads each, within the memory cap;
    when the cap is tight slots shrink (to MIN_SLOT_BYTES) before their count drops (to 2)."""
    want_slots = max(2, ranks * (readers + 2))
    slot = max(MIN_SLOT_BYTES, round_down(chunk_bytes, IO_ALIGN))
    cap = min(MAX_POOL_BYTES, memory_limit // POOL_SHARE) if memory_limit > 0 else MAX_POOL_BYTES
    if want_slots * slot > cap:
        slot = max(MIN_SLOT_BYTES, round_down(cap // want_slots, IO_ALIGN))
    slots = max(2, min(want_slots, cap // slot))
    return Geometry(slots, slot)


class StagingPool:
    """`slots` aligned host buffers of `slot_bytes`; `lease` hands some out to one load.

    Pinned pools are page-locked in place (cudaHostRegister, Portable: for every device's
    context; exactly the bytes asked for, where torch's pinned allocator would round 1.1 GiB up
    to 2), slot by slot: all at once where the worker prepares the pool (`pin_all`), else each
    slot the first time a chunk is read into it (`pin`), so a warm load whose chunks are all
    registered page-cache windows never pays for pinning at all. A slot the driver refuses to
    pin stays pageable: copies from it are still correct (CUDA copies pageable memory through
    its own staging before the call returns), only slower."""

    def __init__(self, geometry: Geometry, *, pinned: bool, pin_now: bool = False) -> None:
        self.geometry = geometry
        self.pinned = pinned
        self._keep = mmap.mmap(-1, geometry.nbytes)  # page aligned, zero-fill on first touch
        self.memory = torch.frombuffer(self._keep, dtype=torch.uint8)
        sb = geometry.slot_bytes
        self.slots = [self.memory[i * sb : (i + 1) * sb] for i in range(geometry.slots)]
        self._free = list(range(geometry.slots))
        self._cond = threading.Condition()
        self._pin_locks = [threading.Lock() for _ in range(geometry.slots)]
        self._pin_state: list[bool | None] = [None] * geometry.slots  # None: not tried yet
        if pinned and pin_now:
            self.pin_all()

    def pin(self, slot: int) -> bool:
        """Page-lock one slot (once; thread-safe). Whether it is pinned."""
        if not self.pinned:
            return False
        state = self._pin_state[slot]
        if state is not None:
            return state
        with self._pin_locks[slot]:
            if self._pin_state[slot] is None:
                why = registered.host_register(
                    self.slots[slot].data_ptr(),
                    self.slot_bytes,
                    registered.CUDA_HOST_REGISTER_PORTABLE,
                )
                if why is not None and False not in self._pin_state:
                    log.warning("staging slot %d not pinned (%s): pageable copies", slot, why)
                self._pin_state[slot] = why is None
            return bool(self._pin_state[slot])

    def pin_all(self) -> int:
        """Pin every slot; returns how many are pinned."""
        return sum(self.pin(i) for i in range(self.geometry.slots))

    @property
    def slot_bytes(self) -> int:
        return self.geometry.slot_bytes

    @property
    def nbytes(self) -> int:
        return self.geometry.nbytes

    def acquire(self, want: int) -> list[int]:
        """Up to `want` slot numbers (at least min(want, 2, all slots)); blocks until free."""
        least = max(1, min(want, 2, self.geometry.slots))
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= least)
            take = min(want, len(self._free))
            got, self._free = self._free[:take], self._free[take:]
            return got

    def release(self, slots: list[int]) -> None:
        """Give slots back. The caller has waited for every copy reading them."""
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    @contextmanager
    def lease(self, want: int) -> Iterator[list[int]]:
        got = self.acquire(want)
        try:
            yield got
        finally:
            self.release(got)


_pools: dict[bool, Future[StagingPool]] = {}
_pools_lock = threading.Lock()


def _allocate(
    fut: Future[StagingPool], geometry: Geometry, pinned: bool, pin_now: bool = False
) -> None:
    try:
        pool = StagingPool(geometry, pinned=pinned, pin_now=pin_now)
    except BaseException as exc:
        log.warning("staging pool of %d bytes not allocated: %s", geometry.nbytes, exc)
        with _pools_lock:  # the next load tries again
            if _pools.get(pinned) is fut:
                del _pools[pinned]
        fut.set_exception(exc)
        return
    log.info(
        "staging pool: %d x %d MiB %s",
        geometry.slots,
        geometry.slot_bytes >> 20,
        "pinned" if pinned else "pageable",
    )
    fut.set_result(pool)


def _claim(pinned: bool, geometry: Geometry) -> tuple[Future[StagingPool], bool]:
    """The pool's future, and whether the caller must allocate it."""
    with _pools_lock:
        fut = _pools.get(pinned)
        if fut is not None:
            return fut, False
        fut = _pools[pinned] = Future()
        return fut, True


def staging_pool(*, pinned: bool, geometry: Geometry | None = None) -> StagingPool:
    """This process's pool of that kind, made on first use: a load that comes while the worker
    still allocates it waits for that. `geometry` only counts for the first call."""
    geometry = geometry or pool_geometry(
        podlimits.memory_limit(), podlimits.reader_threads(), DEFAULT_CHUNK
    )
    fut, mine = _claim(pinned, geometry)
    if mine:
        _allocate(fut, geometry, pinned)
    try:
        return fut.result()
    except Exception as exc:
        if mine:
            raise
        log.warning("staging pool allocated at start failed (%s); allocating again", exc)
    fut, mine = _claim(pinned, geometry)
    if mine:
        _allocate(fut, geometry, pinned)
    return fut.result()


def claimed(pinned: bool) -> bool:
    """Whether this process holds (or is allocating) its pool of that kind: its memory is
    then already out of what the host has available."""
    with _pools_lock:
        return pinned in _pools


def plan_uses_cuda(plan: WorkerPlan) -> bool:
    """Whether this plan's ranks load onto CUDA (the builtin engine's resolve_devices rule)."""
    if plan.device.startswith("cuda"):
        return True
    if plan.device != "auto":
        return False
    return torch.cuda.is_available() and 0 < len(plan.ranks) <= torch.cuda.device_count()


def staging_geometry(plan: WorkerPlan, memory_limit: int | None = None) -> Geometry:
    """The pool a plan's preload onto CUDA uses (what the host-memory check counts)."""
    opts = plan.loading.preload
    limit = podlimits.memory_limit() if memory_limit is None else memory_limit
    readers = opts.threads or podlimits.reader_threads()
    return pool_geometry(limit, readers, opts.chunk_mib << 20, len(plan.ranks))


def prepare_staging(plan: WorkerPlan) -> threading.Thread | None:
    """At worker start, for a plan that may preload onto CUDA: allocate the pinned pool (and
    with it the CUDA context) in a thread, beside the init hooks. None when not needed (or
    already made)."""
    from weightlift.api.model import LoadStrategy

    if plan.strategy == LoadStrategy.DIRECT or not plan_uses_cuda(plan):
        return None
    geometry = staging_geometry(plan)
    pinned = plan.loading.preload.pinned
    fut, mine = _claim(pinned, geometry)
    if not mine:
        return None
    thread = threading.Thread(
        target=_allocate, args=(fut, geometry, pinned, True), name="wl-staging", daemon=True
    )
    thread.start()
    return thread
