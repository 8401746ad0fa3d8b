"""Standby: a Target created before any source is Ready does what needs no weights, then waits
for the operator to hand it peers.

The hand-off is the pod's weightlift.dev/peers annotation (api.worker.PeerHandoff as JSON),
projected into a file by a downwardAPI volume; the kubelet rewrites that file in place when the
annotation changes (an atomic `..data` symlink swap), so the waiting worker polls one small file
and never restarts. Peers are checked as always: the pull names this pod's model identity and
sends its peer token, and a source of another identity refuses (p2p/target.py).

The wait is bounded twice: the operator hands storage when no source is Ready within
`waitForSourceSeconds`; should the operator say nothing (it is down), the worker itself loads
from storage a grace period later. A warm spare (spec.warmSpares) is the exception: it waits
until a scale-up hands it something.

A pod of a multi-pod replica (`podsPerReplica` > 1, a LeaderWorkerSet group) always starts
here, whatever its assignment says: one template serves every group, so its role (storage: a
source group; peers: a target group, rank-matched) and its group's `leader` come with the
hand-off. It waits without a bound of its own: storage alone would not say where its leader is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from weightlift.api.model import Role, pulls_from_peers
from weightlift.api.worker import PEERS_FILE_ENV, PeerHandoff, WorkerPhase, WorkerPlan, WorkerReport
from weightlift.worker.weights.progress import LoadError

if TYPE_CHECKING:  # torch comes with the engine that reserves memory, not with this module
    import torch

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# Beyond waitForSourceSeconds: how long a worker waits for the operator's own decision.
OPERATOR_GRACE_SECONDS = 60.0
# A warm spare waits for the operator's hand-off without a bound of its own (a year: finite,
# so deadlines stay plain arithmetic).
SPARE_WAIT_SECONDS = 365 * 86400.0


def handoff_path(environ: dict[str, str] | None = None) -> Path | None:
    value = (os.environ if environ is None else environ).get(PEERS_FILE_ENV)
    return Path(value) if value else None


def in_group(plan: WorkerPlan) -> bool:
    return (plan.pods_per_replica or 1) > 1


class HandoffRefused(LoadError):
    """The hand-off cannot be followed (a group pod's without its leader); the operator's
    annotation stays as it is, so retrying does not help."""

    permanent = True


def starts_in_standby(plan: WorkerPlan, path: Path | None) -> bool:
    """A Target that may pull from peers, created without any: it waits to be handed them. A
    pod of a group, always."""
    if in_group(plan):
        return path is not None
    return (
        path is not None
        and plan.role == Role.TARGET
        and pulls_from_peers(plan.loading, plan.runtime)
        and not plan.peers
    )


def read_handoff(path: Path) -> PeerHandoff | None:
    """What the hand-off file says now; None while nothing is handed (or it is unreadable)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    handoff = PeerHandoff.parse(text)
    return handoff if handoff is not None and handoff.given else None


async def wait_for_handoff(path: Path, limit: float) -> PeerHandoff:
    """Poll the hand-off file until it hands something; storage after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        handoff = read_handoff(path)
        if handoff is not None:
            return handoff
        await asyncio.sleep(POLL_SECONDS)
    log.warning("no peers handed within %.0fs (%s): loading from storage", limit, path)
    return PeerHandoff(storage=True)


def wait_for_handoff_blocking(path: Path, limit: float) -> PeerHandoff:
    """`wait_for_handoff` for a thread with no event loop (a vLLM rank's weight step)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        handoff = read_handoff(path)
        if handoff is not None:
            return handoff
        time.sleep(POLL_SECONDS)
    log.warning("no peers handed within %.0fs (%s): loading from storage", limit, path)
    return PeerHandoff(storage=True)


def wait_limit(plan: WorkerPlan) -> float:
    if plan.spare or in_group(plan):
        # A spare serves only when a scale-up asks for it; a group pod needs its leader.
        return SPARE_WAIT_SECONDS
    return plan.loading.wait_for_source_seconds + OPERATOR_GRACE_SECONDS


def reserve_destination(plan: WorkerPlan, devices: dict[int, torch.device]) -> int:
    """Allocate and fault in each local rank's pull buffer (sized from the shard headers, as
    the pull lays it out); returns the bytes reserved. A rank whose headers cannot be read
    reserves nothing: its pull allocates as usual and says what is wrong."""
    from weightlift.worker.p2p import reserve
    from weightlift.worker.p2p.expected import expected_for_rank
    from weightlift.worker.p2p.target import layout_size

    total = 0
    for rank in plan.ranks:
        try:
            expected = expected_for_rank(
                plan.model_dir, rank, plan.tensor_parallel, plan.model.dtype
            )
        except (LoadError, ValueError, OSError) as exc:
            log.info("rank %d: nothing reserved ahead of the pull (%s)", rank, exc)
            continue
        size = layout_size(expected) if expected is not None else None
        if size is not None:
            reserve.reserve(devices[rank], size)
            total += size
    return total


def apply_handoff(plan: WorkerPlan, handoff: PeerHandoff) -> WorkerPlan:
    """The plan with the handed peers (none: storage), and reserved memory freed for storage.
    A group pod's role is the hand-off's (Target with peers, else Source)."""
    if in_group(plan):
        if not handoff.leader:
            raise HandoffRefused(
                f"a pod of a {plan.pods_per_replica}-pod replica was handed "
                f"{handoff.to_text()} without its group's leader (host:port)"
            )
        role = Role.TARGET if handoff.peers and not handoff.storage else Role.SOURCE
        plan = plan.model_copy(update={"role": role})
    if handoff.storage or not handoff.peers:
        from weightlift.worker.p2p import reserve

        freed = reserve.release()
        if freed:
            log.info("handed storage: released %d reserved bytes", freed)
        return plan.model_copy(update={"peers": []})
    return plan.model_copy(update={"peers": list(handoff.peers)})


async def receive_handoff(
    report: WorkerReport, path: Path, plan: WorkerPlan
) -> tuple[WorkerPlan, PeerHandoff]:
    """Phase Standby until the hand-off file names peers or storage; the plan to load with and
    the hand-off. The report's timeline gets `standby` (prepared, waiting) and `peers`
    (handed)."""
    report.phase = WorkerPhase.STANDBY
    report.timeline["standby"] = round(time.time(), 3)
    handoff = await wait_for_handoff(path, wait_limit(plan))
    report.timeline["peers"] = round(time.time(), 3)
    log.info("standby over: %s", handoff.to_text())
    handed = apply_handoff(plan, handoff)
    report.role = str(Role.SOURCE) if not handed.peers else str(handed.role)
    return handed, handoff


async def hand_off(report: WorkerReport, path: Path, plan: WorkerPlan) -> WorkerPlan:
    """`receive_handoff`'s plan."""
    return (await receive_handoff(report, path, plan))[0]
