"""The one place a worker decides how a rank's weights arrive: PeerToPeer, Preload or Direct.

The operator decides role and peers (the WorkerPlan); here the worker picks the strategy. A
Target with peer candidates under Auto or PeerToPeer pulls over NIXL first (`load_from_peers`)
and falls back to storage when no peer delivers. Storage is Preload or Direct
(`choose_storage_loader`): Auto (and PeerToPeer's fallback) preloads when the shards fit in
`hostMemoryFraction` of the host memory still available.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from weightlift.api.model import LoadStrategy, Role, pulls_from_peers
from weightlift.worker.loaders.base import Loader
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.progress import LoadError, LoadProgress

if TYPE_CHECKING:
    import torch

    from weightlift.api.worker import WorkerPlan
    from weightlift.worker.p2p.target import PullOptions

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


def host_bytes_needed(
    plan: WorkerPlan, devices: dict[int, torch.device], *, memory_limit: int | None = None
) -> int:
    """Host memory the preload holds: on CPU every local shard stays resident in the page cache
    (mapped, populated); on CUDA the files stream through the process's staging pool (pinned,
    held for the worker's life: counted unless this process already holds it, when it is out
    of the available memory already), and we still ask for the shards to fit so the page cache
    can hold them for the next load. `memory_limit` sizes the pool (default: the pod's)."""
    need = sum(shard_index(plan.model_dir, r, plan.tensor_parallel).data_bytes for r in plan.ranks)
    if any(d.type == "cuda" for d in devices.values()):
        from weightlift.worker.loaders.staging import claimed, staging_geometry

        if not claimed(plan.loading.preload.pinned):
            need += staging_geometry(plan, memory_limit).nbytes
    return need


def choose_storage_loader(
    plan: WorkerPlan,
    devices: dict[int, torch.device],
    *,
    available: int | None = None,
) -> Loader:
    """Preload or Direct, per `plan.loading.strategy` (Auto and PeerToPeer decide by memory)."""
    # Imported here: the loaders bring torch, which a vLLM or Triton worker's front process
    # (it only decides, then starts the engine) would otherwise import for ~1 s before vLLM.
    from weightlift.worker.loaders.direct import DirectLoader
    from weightlift.worker.loaders.preload import PreloadLoader

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


def wants_peer_to_peer(plan: WorkerPlan) -> bool:
    """A Target with candidates pulls from a peer when the strategy and runtime allow it (the
    same rule the operator applies when it decides whether waiting for a source helps)."""
    return (
        plan.role == Role.TARGET
        and pulls_from_peers(plan.loading, plan.runtime)
        and bool(plan.peers)
    )


def load_from_peers(
    plan: WorkerPlan,
    rank: int,
    device: torch.device,
    progress: LoadProgress,
    *,
    pull_options: PullOptions | None = None,
) -> dict[str, torch.Tensor] | None:
    """Rank `rank`'s tensors from a peer, or None: P2P is not wanted, not installed, or no peer
    delivered (each failure logged); the caller then loads from storage with
    `choose_storage_loader`. `pull_options` replaces the options derived from the plan."""
    if not wants_peer_to_peer(plan):
        return None
    try:
        from weightlift.worker.loaders.p2p import PeerToPeerLoader
    except ImportError as exc:  # the worker image without the p2p extra
        log.warning("rank %d: P2P loader unavailable (%s); loading from storage", rank, exc)
        return None
    try:
        tensors = PeerToPeerLoader(options=pull_options).load(plan, rank, device, progress)
    except LoadError as exc:
        log.warning("rank %d: P2P failed (%s); falling back to storage", rank, exc)
        progress.reset()
        return None
    progress.loaded_from = progress.loaded_from or "peer"
    return tensors
