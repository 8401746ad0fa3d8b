"""Metrics recorded from the transitions a pass writes: once per replica, whatever the number of
passes, a lagging pod index or an operator restart. The plans are planning's real ones."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from prometheus_client import CollectorRegistry

from tests.support.planning import T0, make_spec, mkpod, observe
from weightlift.api.labels import WOKEN_ANNOTATION
from weightlift.api.model import ModelDeploymentSpec, ModelDeploymentStatus, Role
from weightlift.api.worker import PeerCandidate, PeerHandoff, WorkerReport
from weightlift.operator.metrics import Metrics
from weightlift.operator.planning import ObservedPod, Plan, plan
from weightlift.operator.reconcile import _status_patch
from weightlift.operator.state import OperatorState
from weightlift.operator.transitions import record_pass

UID = "md-uid"


def _state() -> OperatorState:
    metrics = Metrics(CollectorRegistry(), process=False)
    none = cast(Any, None)
    return OperatorState(core=none, custom=none, http=none, metrics=metrics)


def _value(state: OperatorState, name: str, **labels: str) -> float:
    got = state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def _stamp(seconds_ago: float) -> str:
    moment = datetime.fromtimestamp(time.time() - seconds_ago, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _raw(pods: list[ObservedPod], age: float = 30.0) -> list[dict[str, Any]]:
    """The pod index's entries for these pods (what record_pass reads: name, uid, created)."""
    return [
        {"metadata": {"name": p.name, "uid": f"uid-{p.name}", "creationTimestamp": _stamp(age)}}
        for p in pods
    ]


class Passes:
    """Plan, 'write' and record, pass after pass, as reconcile does after a successful apply."""

    def __init__(self, spec: ModelDeploymentSpec, state: OperatorState) -> None:
        self.spec, self.state = spec, state
        self.written: dict[str, Any] = {}

    def run(self, pods: list[ObservedPod], handed_at: float | None = None) -> Plan:
        previous = ModelDeploymentStatus.model_validate(self.written) if self.written else None
        result = plan(self.spec, observe(pods, previous=previous))
        at = time.time() if handed_at is None else handed_at
        record_pass(self.state, UID, self.spec, result, self.written, pods, _raw(pods), at)
        self.written = {k: v for k, v in _status_patch(result.status).items() if v is not None}
        return result


def _serving(spec: ModelDeploymentSpec, replica: int, role: Role, **report: Any) -> ObservedPod:
    pod = mkpod(spec, replica, role)
    assert pod.worker is not None
    worker = pod.worker.model_copy(update=report)
    return mkpod(spec, replica, role, worker=worker)


def test_time_to_ready_once_per_replica_across_passes_and_a_restart() -> None:
    spec = make_spec(2)
    state = _state()
    passes = Passes(spec, state)
    source_loading = mkpod(spec, 0, Role.SOURCE, state="loading")
    t_standby = time.time() - 10
    standby = mkpod(
        spec, 1, Role.TARGET, state="loading",
        worker=WorkerReport(phase="Standby", timeline={"standby": t_standby}),
    )  # fmt: skip
    passes.run([source_loading, standby])
    assert _value(state, "weightlift_replicas", phase="Loading") == 1
    assert _value(state, "weightlift_replicas", phase="Standby") == 1
    # The source passes its probe: Ready, and the Target in standby is handed it.
    source = _serving(spec, 0, Role.SOURCE, loaded_from="storage:pvc", compile_cache="none")
    handed_at = time.time() - 2
    result = passes.run([source, standby], handed_at=handed_at)
    assert standby.name in result.handoff and result.handoff[standby.name].peers
    ready = {"role": "Source", "loaded_from": "storage:pvc", "engine": "Builtin"}
    assert _value(state, "weightlift_replica_time_to_ready_seconds_count", **ready) == 1
    assert 29 <= _value(state, "weightlift_replica_time_to_ready_seconds_sum", **ready) <= 40
    # The worker sees its hand-off 1.5 s after it was written.
    handoff = PeerHandoff(peers=[PeerCandidate(pod=source.name, address="10.0.0.10:8000")])
    pulling = mkpod(
        spec, 1, Role.TARGET, state="loading", handoff=handoff,
        worker=WorkerReport(
            phase="Loading", timeline={"standby": t_standby, "peers": handed_at + 1.5}
        ),
    )  # fmt: skip
    for _ in range(3):  # more passes: nothing is observed twice
        passes.run([source, pulling])
    assert _value(state, "weightlift_handoff_latency_seconds_count", handed="peers") == 1
    assert _value(state, "weightlift_handoff_latency_seconds_sum", handed="peers") == 1.5
    assert _value(state, "weightlift_replica_time_to_ready_seconds_count", **ready) == 1
    # The target is Ready with the source's compiled program.
    target = _serving(
        spec, 1, Role.TARGET, loaded_from=f"peer:{source.name}", compile_cache="hit",
        timeline={"standby": t_standby, "peers": handed_at + 1.5},
    )  # fmt: skip
    target = mkpod(spec, 1, Role.TARGET, worker=target.worker, handoff=handoff)
    for _ in range(3):
        passes.run([source, target])
    peer = {"role": "Target", "loaded_from": "peer", "engine": "Builtin"}
    assert _value(state, "weightlift_replica_time_to_ready_seconds_count", **peer) == 1
    assert (
        _value(state, "weightlift_compile_cache_total", engine="Builtin", outcome="hit_peer") == 1
    )
    assert _value(state, "weightlift_compile_cache_total", engine="Builtin", outcome="none") == 1
    assert _value(state, "weightlift_standby_wait_seconds_count", handed="peers") == 1
    wait = _value(state, "weightlift_standby_wait_seconds_sum", handed="peers")
    assert abs(wait - (handed_at + 1.5 - t_standby)) < 0.01
    assert _value(state, "weightlift_storage_fallbacks_total", reason="peer_failed") == 0
    assert _value(state, "weightlift_replicas", phase="Ready") == 2
    assert _value(state, "weightlift_deployments", phase="Ready") == 1
    # A restarted (or newly active) operator: no memory, the status it finds says Ready.
    restarted = _state()
    again = Passes(spec, restarted)
    again.written = passes.written
    for _ in range(3):
        again.run([source, target])
    assert _value(restarted, "weightlift_replica_time_to_ready_seconds_count", **ready) == 0
    assert _value(restarted, "weightlift_replica_time_to_ready_seconds_count", **peer) == 0
    assert _value(restarted, "weightlift_replicas", phase="Ready") == 2  # gauges: current
    # The deployment goes: it leaves the gauges.
    restarted.forget(UID)
    assert _value(restarted, "weightlift_replicas", phase="Ready") == 0


def test_a_replica_that_flaps_is_timed_once() -> None:
    spec = make_spec(1)
    state = _state()
    passes = Passes(spec, state)
    ready = _serving(spec, 0, Role.SOURCE, loaded_from="storage:pvc")
    failing = mkpod(spec, 0, Role.SOURCE, state="probe-failed")
    for pods in ([ready], [failing], [ready]):
        passes.run(pods)
    labels = {"role": "Source", "loaded_from": "storage:pvc", "engine": "Builtin"}
    assert _value(state, "weightlift_replica_time_to_ready_seconds_count", **labels) == 1


def test_storage_fallbacks_are_counted_once_with_their_reason() -> None:
    spec = make_spec(2, wait=5)
    state = _state()
    passes = Passes(spec, state)
    standby = mkpod(
        spec, 1, Role.TARGET, state="loading",
        worker=WorkerReport(phase="Standby", timeline={"standby": time.time()}),
    )  # fmt: skip
    loading = mkpod(spec, 0, Role.SOURCE, state="loading")
    passes.run([loading, standby])
    # The wait ran out (waiting since 10 s before the plans' clock): the target is handed
    # storage. The pod index lags: the next pass still sees no annotation and hands it storage
    # again.
    expired = (T0 - timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    passes.written["waitingSince"] = expired
    first = passes.run([loading, standby])
    assert first.handoff[standby.name].storage
    passes.written["waitingSince"] = expired
    assert passes.run([loading, standby]).handoff[standby.name].storage
    assert _value(state, "weightlift_storage_fallbacks_total", reason="wait_expired") == 1
    # A target created with peers that loaded from storage: none delivered.
    spec3 = make_spec(3)
    state3 = _state()
    p3 = Passes(spec3, state3)
    src = _serving(spec3, 0, Role.SOURCE, loaded_from="storage:pvc")
    fell_back = _serving(spec3, 1, Role.TARGET, loaded_from="storage:pvc")
    pulled = _serving(spec3, 2, Role.TARGET, loaded_from=f"peer:{src.name}")
    for _ in range(2):
        p3.run([src, fell_back, pulled])
    assert _value(state3, "weightlift_storage_fallbacks_total", reason="peer_failed") == 1
    assert _value(state3, "weightlift_storage_fallbacks_total", reason="wait_expired") == 0


def test_a_woken_spare_is_timed_from_its_wake_not_its_creation() -> None:
    """A spare waits by design (here an hour): its time to Ready starts at the scale-up that woke
    it (the woken-at annotation the wake patch sets), and its wait is no standby wait for a
    source. Spares count in the replica gauge as phase Spare."""
    spec = make_spec(1, warmSpares=1)
    state = _state()
    passes = Passes(spec, state)
    source = _serving(spec, 0, Role.SOURCE, loaded_from="storage:pvc", compile_cache="none")
    t_standby = time.time() - 3600
    spare = mkpod(
        spec, 1, Role.TARGET, state="loading", spare=True,
        worker=WorkerReport(phase="Standby", timeline={"standby": t_standby}),
    )  # fmt: skip
    passes.run([source, spare])
    assert _value(state, "weightlift_replicas", phase="Spare") == 1
    passes.spec = spec = make_spec(2, warmSpares=1)
    result = passes.run([source, spare])
    assert result.unspare == {spare.name}
    handoff = result.handoff[spare.name]
    woken = mkpod(
        spec, 1, Role.TARGET, handoff=handoff,
        worker=WorkerReport(
            phase="Serving", loaded_from=f"peer:{source.name}", compile_cache="hit",
            timeline={"standby": t_standby, "peers": time.time() - 4},
        ),
    )  # fmt: skip
    raw = _raw([source, woken], age=3600)
    raw[1]["metadata"]["annotations"] = {WOKEN_ANNOTATION: _stamp(5)}
    previous = passes.written
    result = plan(spec, observe([source, woken], previous=ModelDeploymentStatus(**previous)))
    record_pass(state, UID, spec, result, previous, [source, woken], raw, time.time())
    peer = {"role": "Target", "loaded_from": "peer", "engine": "Builtin"}
    assert _value(state, "weightlift_replica_time_to_ready_seconds_count", **peer) == 1
    assert 4 <= _value(state, "weightlift_replica_time_to_ready_seconds_sum", **peer) <= 15
    assert _value(state, "weightlift_standby_wait_seconds_count", handed="peers") == 0
