"""What a reconcile pass changed, recorded in the metrics once per transition.

A pass records only after `apply` succeeded (its hand-offs patched, its status written or held
for a coalesced write: statuswrites.py), and compares the status it planned with the one planned
before (`previous`: this operator's own, or after a restart the one in the API server). So a
replica's time to Ready is observed by the pass that first plans it Ready, never again by a later
pass, nor by a restarted or standby operator that finds it Ready already. Per-pod memory
(PodRecord) guards the rest: a hand-off the pod index has not caught up with is not counted
twice, and a replica that flaps Ready -> not Ready -> Ready is timed once. What lives only in
memory (the moment of a hand-off) is lost with the process: at most one sample goes missing,
none is recorded twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from weightlift.api.labels import WOKEN_ANNOTATION
from weightlift.api.model import ModelDeploymentSpec, ReplicaStatus, Role
from weightlift.api.times import parse_rfc3339
from weightlift.operator.metrics import (
    compile_cache_label,
    engine_of,
    loaded_from_label,
)
from weightlift.operator.planning import ObservedPod, Plan, SpecError
from weightlift.operator.state import OperatorState


def record_pass(
    state: OperatorState,
    uid: str,
    spec: ModelDeploymentSpec | SpecError,
    result: Plan,
    previous: Mapping[str, Any],
    observed: list[ObservedPod],
    pods: list[dict[str, Any]],
    handed_at: float,
) -> None:
    """After a successful apply. `handed_at`: wall time the pass began applying."""
    metrics = state.metrics
    status = result.status
    metrics.count_phases(uid, Counter(r.phase for r in status.replica_statuses), status.phase)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    for name, handoff in result.handoff.items():
        if (pod_uid := uids.get(name)) is None:
            continue
        record = state.pod(pod_uid)
        handed = "storage" if handoff.storage else "peers"
        if record.handed != handed:  # the index lags: a repeated hand-off is the same one
            record.handed, record.handed_at = handed, handed_at
            if name in result.fallbacks:
                metrics.fallback(result.fallbacks[name])
    by_name = {o.name: o for o in observed}
    for pod in observed:
        _seen_handoff(state, uids.get(pod.name), pod)
    if isinstance(spec, SpecError):
        return
    was_ready = {r.get("name") for r in previous.get("replicaStatuses") or [] if r.get("ready")}
    created = {p["metadata"]["name"]: p["metadata"].get("creationTimestamp") for p in pods}
    # A woken spare's time to Ready starts when a scale-up woke it: it was created to wait.
    woken = {
        p["metadata"]["name"]: at
        for p in pods
        if (at := (p["metadata"].get("annotations") or {}).get(WOKEN_ANNOTATION))
    }
    for replica in status.replica_statuses:
        pod_uid = uids.get(replica.name)
        if not replica.ready or replica.name in was_ready or pod_uid is None:
            continue
        record = state.pod(pod_uid)
        if record.ready_counted:
            continue
        record.ready_counted = True
        name = replica.name
        started = woken.get(name) or created.get(name)
        _became_ready(state, spec, replica, by_name.get(name), started, name in woken)


def _seen_handoff(state: OperatorState, uid: str | None, pod: ObservedPod) -> None:
    """The worker's timeline says when it saw its hand-off (`peers`): the latency from our
    write, once, by what it was handed."""
    record = state.pods.get(uid or "")
    if record is None or record.handed_at is None or pod.worker is None:
        return
    seen = pod.worker.timeline.get("peers")
    if seen is None:
        return
    # Worker and operator clocks: the same host, or NTP apart; a negative gap is clock skew.
    latency = max(0.0, seen - record.handed_at)
    state.metrics.handoff_latency.labels(handed=record.handed or "peers").observe(latency)
    record.handed_at = None


def _became_ready(
    state: OperatorState,
    spec: ModelDeploymentSpec,
    replica: ReplicaStatus,
    pod: ObservedPod | None,
    created: str | None,
    woken: bool = False,
) -> None:
    metrics, engine = state.metrics, engine_of(spec)
    source = loaded_from_label(replica.loaded_from)
    if created:
        try:
            seconds = max(0.0, time.time() - parse_rfc3339(created).timestamp())
        except ValueError:
            seconds = None
        if seconds is not None:
            metrics.time_to_ready.labels(
                role=str(replica.role), loaded_from=source, engine=engine
            ).observe(seconds)
    outcome = compile_cache_label(replica.compile_cache, replica.loaded_from)
    metrics.compile_cache.labels(engine=engine, outcome=outcome).inc()
    report = pod.worker if pod is not None else None
    timeline = report.timeline if report is not None else {}
    handoff = pod.handoff if pod is not None else None
    if "standby" in timeline and "peers" in timeline and not woken:
        # A spare's wait is chosen, not a wait for a source: not in this histogram.
        handed = "storage" if handoff is None or handoff.storage else "peers"
        wait = max(0.0, timeline["peers"] - timeline["standby"])
        metrics.standby_wait.labels(handed=handed).observe(wait)
    if replica.role == Role.TARGET and source.startswith("storage"):
        # Handed storage: counted when handed (the replica is relabelled Source, too). Never
        # handed anything but waited in Standby: the worker's own wait ran out. Otherwise it
        # had peers and none delivered.
        if handoff is not None and handoff.storage:
            return
        metrics.fallback(
            "wait_expired" if handoff is None and "standby" in timeline else "peer_failed"
        )
