"""PeerToPeer loading strategy: pull this rank's shard from a source replica over NIXL.

Candidates come from `plan.peers`; they are tried in rendezvous order of this pod's name (so many
targets spread over many sources). Each candidate gets a fresh buffer; the first one whose every
tensor checksum verifies wins. When all fail, LoadError names every peer and what went wrong and
the worker falls back to storage (Preload/Direct).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightlift.worker.p2p.expected import ExpectedTensor, expected_for_rank
from weightlift.worker.p2p.nixl_compat import NixlUnavailable
from weightlift.worker.p2p.rendezvous import rendezvous_order
from weightlift.worker.p2p.target import (
    PeerFailed,
    PullOptions,
    PullResult,
    forget_pull,
    pull_from_peer,
)
from weightlift.worker.weights.progress import LoadError, LoadProgress

if TYPE_CHECKING:
    import torch

    from weightlift.api.worker import WorkerPlan

log = logging.getLogger(__name__)

# A stalled peer (alive but moving nothing) is dropped after this many seconds at most.
STALL_SECONDS = 5.0
# MB moved by one READ request: 16-256 MB made no measurable difference (bench/p2p.py notes).
DEFAULT_BATCH_BYTES = 64 << 20
_MIN_BATCH_BYTES = 1 << 16


def options_for(
    plan: WorkerPlan, *, batch_bytes: int = DEFAULT_BATCH_BYTES, throttle_s: float = 0.0
) -> PullOptions:
    """Pull options from the plan's PeerToPeer settings. `batch_bytes` and `throttle_s` are for
    whoever builds the loader itself (benchmarks and tests: smaller READs, a slowed link)."""
    p2p = plan.loading.peer_to_peer
    batch = max(batch_bytes, _MIN_BATCH_BYTES)
    return PullOptions(
        batch_bytes=batch,
        chunk_bytes=batch,
        transfer_timeout_s=float(p2p.transfer_timeout_seconds),
        max_in_flight=p2p.max_in_flight,
        stall_seconds=min(STALL_SECONDS, float(p2p.transfer_timeout_seconds)),
        throttle_s=throttle_s,
    )


class PeerToPeerLoader:
    name = "p2p"

    def __init__(
        self,
        options: PullOptions | None = None,
        on_batch: Callable[[int, int], None] | None = None,
        expected: dict[str, ExpectedTensor] | None = None,
        layout: str = "",
    ) -> None:
        """`expected`: what the rank must receive, when the caller knows it better than the
        model's files do (an engine publishing its own per-rank parameters); by default it
        comes from the safetensors headers of the rank's shard. `layout`: who laid those out
        (RankManifest.layout); a peer must name the same."""
        self.options = options
        self.on_batch = on_batch
        self.expected = expected
        self.layout = layout
        self.last_result: PullResult | None = None
        self.failures: list[PeerFailed] = []

    def load(
        self, plan: WorkerPlan, rank: int, device: torch.device, progress: LoadProgress
    ) -> dict[str, torch.Tensor]:
        if not plan.peers:
            raise LoadError(f"rank {rank}: no peer candidates to pull from")
        expected = self.expected
        try:
            if expected is None:
                expected = expected_for_rank(
                    plan.model_dir, rank, plan.tensor_parallel, plan.model.dtype
                )
        except (LoadError, ValueError, OSError) as exc:
            raise LoadError(f"rank {rank}: cannot read the model's shard headers: {exc}") from exc
        opts = self.options or options_for(plan)
        self.failures = []
        for cand in rendezvous_order(plan.pod_name, plan.peers):
            progress.reset()
            try:
                result = pull_from_peer(
                    pod=cand.pod,
                    address=cand.address,
                    identity=plan.model_identity,
                    rank=rank,
                    reader=plan.pod_name,
                    device=device,
                    expected=expected,
                    opts=opts,
                    progress=progress,
                    on_batch=self.on_batch,
                    layout=self.layout,
                )
            except PeerFailed as exc:
                forget_pull(exc, device)  # its buffer freed before the next one is allocated
                self.failures.append(exc)
                if exc.kind == "emulated":
                    # This node's UCX, not the peer, lacks a GPU transport: every candidate
                    # would be emulated the same way. The note goes to the status.
                    progress.transport = exc.transport
                    progress.transport_note = str(exc).removeprefix(f"peer {exc.peer}: ")
                    break
                log.warning("rank %d: %s; trying the next candidate", rank, exc)
                continue
            except NixlUnavailable as exc:
                raise LoadError(f"rank {rank}: {exc}") from exc
            self.last_result = result
            progress.loaded_from = f"peer:{cand.pod}"
            progress.transport = result.transport
            progress.transport_note = result.transport_note
            progress.phases = {**result.phases(), **result.overlapped()}
            progress.finish()
            log.info(
                "rank %d: %d bytes from peer %s over %s in %.3fs (%.2f GB/s), %d checksums "
                "verified; phases since start: %s",
                rank,
                result.nbytes,
                cand.pod,
                result.transport,
                result.seconds,
                result.nbytes / result.seconds / 1e9 if result.seconds else 0.0,
                len(result.tensors),
                {k: round(v, 3) for k, v in result.timings.items()},
            )
            return result.tensors
        progress.reset()
        raise LoadError(
            f"rank {rank}: all {len(self.failures)} peer(s) failed: "
            + "; ".join(str(f) for f in self.failures)
        )
