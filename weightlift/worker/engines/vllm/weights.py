"""The engine-side weight path of the vLLM load format, free of vLLM imports (unit-testable).

What each rank publishes: **its own parameters as vLLM holds them after `model.load_weights`
and before `process_weights_after_loading`**, one P2P source per tensor-parallel rank. A target
rank pulls only its rank's tensors (the fused qkv / gate_up stacking, the TP slice and the dtype
cast are already done), copies them into its parameters and runs vLLM's own post-load
processing. Why not after processing, as ModelExpress publishes: vLLM's processing is not
portable: on CPU it repacks every linear weight into an opaque oneDNN / sgl-kernel handle and
leaves `layer.weight` empty, and on GPU quantized kernels permute and repack; a target must run
it itself. Why not the checkpoint files, as TRT-LLM's presharded path and our first version
did: every rank of a target would pull the whole checkpoint to slice out its share.

Cost of that choice: each source rank keeps a host copy of its pre-processing parameters
(one packed buffer; a target publishes the buffer it pulled into, no extra copy). The
parameters depend on vLLM's tensor-parallel size, dtype and engine args, which are part of the
model identity (operator/identity.py), so only replicas that hold the same tensors meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightlift.api.uri import ModelUri
from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.vllm.ranks import has_weights
from weightlift.worker.hooks import InitHookSession, local_device_index, run_init_hooks
from weightlift.worker.loaders.strategy import choose_storage_loader, wants_peer_to_peer
from weightlift.worker.p2p.expected import ExpectedTensor
from weightlift.worker.storage.fetch import Fetched, is_remote, materialize
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import dtype_name, pack

log = logging.getLogger("vllm.weightlift")  # vLLM's handler only prints `vllm.*` loggers

CPU = torch.device("cpu")


def _storage_label(plan: WorkerPlan) -> str:
    return f"storage:{ModelUri.parse(plan.model.uri).scheme}"


def run_rank_hooks(plan: WorkerPlan, rank: int) -> InitHookSession | None:
    """The model's init hooks for one vLLM rank, in that rank's process, before its weights
    load (device index: the pod-local one of the device the rank drives, the rank on CPU);
    HookError fails closed."""
    if plan.init_hooks is None:
        return None
    return run_init_hooks(plan.init_hooks, plan.model_dir, [local_device_index(rank)])


def checkpoint_plan(plan: WorkerPlan) -> WorkerPlan:
    """The plan the storage loaders see: one 'rank' holding the whole HF checkpoint, bytes as
    stored (vLLM slices and casts in its own load_weights), whatever vLLM's TP size is."""
    model = plan.model.model_copy(update={"dtype": "auto"})
    return plan.model_copy(update={"tensor_parallel": 1, "ranks": [0], "model": model})


@dataclass
class CheckpointLoad:
    tensors: dict[str, torch.Tensor]
    progress: LoadProgress
    strategy: str


def load_checkpoint(plan: WorkerPlan, progress: LoadProgress | None = None) -> CheckpointLoad:
    """The checkpoint's tensors in host memory, from storage (preload or direct). A remote
    model whose weights are not in the model dir yet is downloaded first (`fetch_weights`)."""
    progress = progress or LoadProgress()
    loaded_from = _storage_label(plan)
    if is_remote(plan) and not has_weights(plan.model_dir):
        fetched = fetch_weights(plan, progress)
        plan = plan.model_copy(update={"model_dir": fetched.model_dir})
        loaded_from = fetched.loaded_from
    cplan = checkpoint_plan(plan)
    loader = choose_storage_loader(cplan, {0: CPU})
    tensors = loader.load(cplan, 0, CPU, progress)
    progress.loaded_from = loaded_from
    progress.finish()
    return CheckpointLoad(tensors, progress, loader.name)


def fetch_weights(plan: WorkerPlan, progress: LoadProgress) -> Fetched:
    """The worker's own download (`materialize`, node cache included) of a remote model's
    weights, once per pod: every rank's process falls back on its own, so the first takes a
    lock on the model dir and the others find the files there (or the cache entry) after it."""
    lock_path = Path(plan.model_dir) / ".weightlift-weights.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if has_weights(plan.model_dir):  # another rank fetched them
                return Fetched(plan.model_dir, _storage_label(plan))
            return materialize(plan, progress, weights=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class RankLoad:
    """One rank's parameters loaded, and what it publishes: its pre-processing parameters."""

    published: dict[str, torch.Tensor]
    progress: LoadProgress
    strategy: str
    peer_failures: list[str] = field(default_factory=list)


def expected_parameters(params: dict[str, torch.Tensor]) -> dict[str, ExpectedTensor]:
    """What a peer's manifest must hold for these parameters: every name, dtype and shape."""
    return {n: ExpectedTensor(dtype_name(p.dtype), tuple(p.shape)) for n, p in params.items()}


def load_rank(
    plan: WorkerPlan,
    rank: int,
    params: dict[str, torch.Tensor],
    feed: Callable[[dict[str, torch.Tensor]], None],
    layout: str = "",
) -> RankLoad:
    """Fill rank `rank`'s parameters `params` (vLLM's model.named_parameters()). A Target pulls
    exactly these tensors from a peer's same rank (checksums verified) and copies them in; a
    Source, or a Target whose peers all fail, reads the checkpoint from storage and hands it to
    `feed` (vLLM's model.load_weights), then snapshots the parameters to publish them.
    `layout`: the vLLM version that laid `params` out; a peer must publish the same."""
    progress = LoadProgress()
    failures: list[str] = []
    if wants_peer_to_peer(plan):  # the worker's one rule, for the parameters inside vLLM
        from weightlift.worker.loaders.p2p import PeerToPeerLoader

        # Host memory on GPU hosts too: the pulled buffer stays published after the copy into
        # the device parameters, and a second device copy of the model would not fit.
        p2p = PeerToPeerLoader(expected=expected_parameters(params), layout=layout)
        try:
            pulled = p2p.load(plan, rank, CPU, progress)
        except LoadError as exc:
            failures = [str(f) for f in p2p.failures] or [str(exc)]
            log.warning("weightlift: rank %d: P2P failed (%s); loading from storage", rank, exc)
            progress.reset()
        else:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(pulled[name])
            return RankLoad(pulled, progress, "p2p")
    checkpoint = load_checkpoint(plan, progress)
    feed(checkpoint.tensors)
    with torch.no_grad():
        snapshot = pack(params, CPU)
    return RankLoad(snapshot, progress, checkpoint.strategy, failures)


class PublishedRank:
    """A SourcePublisher of one rank's parameters plus a small HTTP server for its manifest
    routes, in a thread of this rank's (vLLM) process: the NIXL agent must live where the
    memory is. The worker forwards each rank's P2P requests here (engine.ManifestProxy)."""

    def __init__(
        self, plan: WorkerPlan, rank: int, tensors: dict[str, torch.Tensor], layout: str = ""
    ) -> None:
        from aiohttp import web

        from weightlift.worker.p2p.source import SourcePublisher, p2p_app

        self.publisher = SourcePublisher(plan, {rank: tensors}, layout=layout)
        self._loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._runner = web.AppRunner(p2p_app(self.publisher), access_log=None)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="wl-p2p-http", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise LoadError("the P2P manifest server did not start within 10 s")

    def close(self) -> None:
        def stop() -> None:
            self._loop.stop()

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=5)
        self.publisher.close()
