"""Choosing the storage loader: Auto preloads when the shard fits in host memory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from weightlift.api.model import LoadStrategy
from weightlift.worker.loaders.base import Loader
from weightlift.worker.loaders.direct import DirectLoader
from weightlift.worker.loaders.files import shard_index
from weightlift.worker.loaders.preload import PreloadLoader

if TYPE_CHECKING:
    import torch

    from weightlift.api.worker import WorkerPlan

log = logging.getLogger(__name__)


def available_host_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup v2 limit."""
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            current = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - current)
            avail = min(avail, room) if avail else room
    except (OSError, ValueError):
        pass
    return avail


def host_bytes_needed(plan: WorkerPlan, devices: dict[int, torch.device]) -> int:
    """Host memory the preload holds: on CPU every local shard stays resident in the page cache
    (mapped, populated); on CUDA the files stream through a bounded ring of pinned buffers, but
    we still ask for the shards to fit so the page cache can hold them for the next load."""
    del devices  # same need either way today; kept so a smarter policy can tell them apart
    return sum(shard_index(plan.model_dir, r, plan.tensor_parallel).data_bytes for r in plan.ranks)


def choose_storage_loader(
    plan: WorkerPlan,
    devices: dict[int, torch.device],
    *,
    available: int | None = None,
) -> Loader:
    """Preload or Direct, per `plan.loading.strategy` (Auto and PeerToPeer decide by memory)."""
    strategy = plan.strategy
    if strategy == LoadStrategy.PRELOAD:
        return PreloadLoader()
    if strategy == LoadStrategy.DIRECT:
        return DirectLoader()
    need = host_bytes_needed(plan, devices)
    avail = available_host_memory() if available is None else available
    budget = int(avail * plan.loading.preload.host_memory_fraction)
    if need <= budget:
        log.info("Auto: preload (%d bytes fit in %d of %d available)", need, budget, avail)
        return PreloadLoader()
    log.info("Auto: direct (%d bytes exceed %d of %d available)", need, budget, avail)
    return DirectLoader()
