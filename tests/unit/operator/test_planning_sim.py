"""Planning over time: the simulator (tests/support/planning.py) applies each Plan, advances
pods, re-plans; these tests drive whole sequences (cold start, rollover, failures) and check
invariants after every reconcile."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests.support.planning import (
    NAME,
    Cluster,
    ident,
    make_spec,
)
from weightlift.api.model import (
    ModelDeploymentSpec,
    Phase,
    Role,
)
from weightlift.api.worker import WorkerReport
from weightlift.operator.planning import pod_name


@pytest.mark.parametrize("replicas", [0, 1, 2, 5])
@pytest.mark.parametrize("strategy", ["Auto", "PeerToPeer", "Preload", "Direct"])
def test_cold_start_settles_ready_with_the_right_roles(replicas: int, strategy: str) -> None:
    cluster = Cluster(make_spec(replicas, strategy=strategy))
    final = cluster.settle()
    live = cluster.live()
    assert len(live) == replicas
    assert sorted(p.replica for p in live) == list(range(replicas))
    assert final.status.phase == Phase.READY
    assert final.status.ready == f"{replicas}/{replicas}"
    assert final.status.ready_replicas == replicas
    roles = {p.replica: p.role for p in live}
    if strategy in ("Preload", "Direct"):
        assert set(roles.values()) <= {Role.SOURCE}
    elif replicas:
        assert roles[0] == Role.SOURCE
        assert all(roles[i] == Role.TARGET for i in range(1, replicas))
    assert [c.status for c in final.status.conditions] == ["True"] * 4
    # Ready all the way to the Service: every replica labelled for it, its gate True.
    assert all(p.serving_labelled and p.probe_gate for p in live)


def test_cold_start_creates_every_replica_at_once_targets_standby_until_a_source() -> None:
    cluster = Cluster(make_spec(3))
    first = cluster.reconcile()
    created = [(d.replica, d.role, d.peers) for d in first.create]
    assert created == [(0, Role.SOURCE, []), (1, Role.TARGET, []), (2, Role.TARGET, [])]
    assert first.status.waiting_since is not None
    assert first.handoff == {}
    source, *targets = (d.name for d in first.create)
    for target in targets:  # scheduled, running, then Standby: nothing more without peers
        for _ in range(3):
            cluster.advance(target)
        assert cluster.pods[target].in_standby
    for _ in range(3):  # the source: scheduled, running, loaded (probe not yet passed)
        cluster.advance(source)
        step = cluster.reconcile()
        assert step.create == [] and step.handoff == {}, "nothing to hand before a Ready source"
        assert step.status.waiting_since == first.status.waiting_since
        assert step.status.sources == []
        assert step.status.standby == 2
        assert {r.phase for r in step.status.replica_statuses if r.name in targets} == {"Standby"}
    cluster.advance(source)  # probe passes
    step = cluster.reconcile()
    assert step.create == []
    assert sorted(step.handoff) == sorted(targets)
    assert all(
        [p.pod for p in h.peers] == [source] and not h.storage for h in step.handoff.values()
    )
    assert step.status.waiting_since is None
    assert [s.pod for s in step.status.sources] == [source]
    again = cluster.reconcile()  # handed once: the annotation says so, nothing more to hand
    assert again.handoff == {}


def test_wait_for_source_expiry_hands_storage_to_the_waiting_targets() -> None:
    cluster = Cluster(make_spec(3, wait=60))
    first = cluster.reconcile()
    targets = [d.name for d in first.create if d.role == Role.TARGET]
    assert len(targets) == 2
    cluster.now += timedelta(seconds=59)
    early = cluster.reconcile()
    assert early.create == [] and early.handoff == {}
    assert early.requeue_after <= 1.0
    cluster.now += timedelta(seconds=2)
    late = cluster.reconcile()
    assert late.create == []
    assert sorted(late.handoff) == targets
    assert all(h.storage and not h.peers for h in late.handoff.values())
    assert late.relabel == {t: Role.SOURCE for t in targets}
    assert "WaitForSourceExpired" in [e.reason for e in late.events]
    assert late.status.waiting_since is None
    assert first.status.waiting_since is not None


def test_a_standby_target_whose_handed_source_died_gets_another_or_storage() -> None:
    cluster = Cluster(make_spec(3))
    first = cluster.reconcile()
    source, t1, t2 = (d.name for d in first.create)
    cluster.make_ready(source)
    for t in (t1, t2):
        for _ in range(3):
            cluster.advance(t)
    handed = cluster.reconcile()
    assert sorted(handed.handoff) == [t1, t2]
    cluster.make_ready(t1)  # t1 pulled and is Ready; t2 has not read its hand-off yet
    cluster.update(t1, worker=None)
    cluster.update(source, phase="Failed", failure="OOMKilled", pod_ready=False)
    step = cluster.reconcile()
    assert [p.pod for p in step.handoff[t2].peers] == [t1], "the surviving Ready replica"
    cluster.update(t1, phase="Failed", failure="OOMKilled", pod_ready=False)
    cluster.update(t2, handoff=step.handoff[t2])
    step = cluster.reconcile()
    assert step.handoff[t2].storage and step.relabel[t2] == Role.SOURCE
    assert "SourceGone" in [e.reason for e in step.events]


def test_scale_down_during_standby_removes_the_waiting_targets_first() -> None:
    cluster = Cluster(make_spec(4))
    first = cluster.reconcile()
    names = [d.name for d in first.create]
    for name in names[1:3]:  # two targets reach Standby, the last one is still pending
        for _ in range(3):
            cluster.advance(name)
    cluster.advance(names[0])
    cluster.spec = make_spec(2)
    step = cluster.reconcile()
    assert sorted(step.delete) == sorted(names[2:]), step.delete
    assert names[0] not in step.delete


def _rolled(spec: ModelDeploymentSpec, field: str) -> ModelDeploymentSpec:
    changes: dict[str, dict[str, Any]] = {
        "uri": {"model": {"uri": "pvc://models/llama-4"}},
        "revision": {"model": {"revision": "v2"}},
        "format": {
            "model": {"format": "safetensors"},
            "runtime": {"type": "External", "command": ["serve"]},
        },
        "dtype": {"model": {"dtype": "bfloat16"}},
        "tensor": {"parallelism": {"tensor": 2}},
    }
    body = spec.model_dump(by_alias=True)
    for key, value in changes[field].items():
        body[key] = {**body[key], **value}
    return ModelDeploymentSpec.model_validate(body)


@pytest.mark.parametrize("field", ["uri", "revision", "format", "dtype", "tensor"])
@pytest.mark.parametrize(("replicas", "surge"), [(1, 1), (3, 1), (3, 2), (4, 4)])
def test_rollover_never_drops_below_the_ready_count(field: str, replicas: int, surge: int) -> None:
    cluster = Cluster(make_spec(replicas, max_surge=surge))
    cluster.settle()
    old_identity = ident(cluster.spec)
    ready_before = cluster.ready_count()
    assert ready_before == replicas
    cluster.spec = _rolled(cluster.spec, field)
    new_identity = ident(cluster.spec)
    assert new_identity != old_identity

    def invariant(c: Cluster) -> None:
        assert c.ready_count() >= min(replicas, ready_before)
        assert len(c.live()) <= replicas + surge
        assert c.previous is not None and c.previous.ready_replicas >= min(replicas, ready_before)
        # ...nor does the Service: its ready endpoints (labelled, gate True, not terminating).
        endpoints = [p for p in c.pods.values() if p.serving_labelled and p.probe_gate]
        assert sum(not p.terminating for p in endpoints) >= min(replicas, ready_before)

    final = cluster.settle(on_step=invariant)
    assert {p.identity for p in cluster.live()} == {new_identity}
    assert cluster.ready_count() == replicas
    assert final.status.updated_replicas == replicas
    assert final.status.model_identity == new_identity
    # The first new replica loads from storage; the others pull from it (an External runtime,
    # which a safetensors model needs, loads its own weights: every replica from storage).
    roles = sorted((p.replica, p.role) for p in cluster.live())
    assert roles[0][1] == Role.SOURCE
    expected_rest = Role.SOURCE if field == "format" else Role.TARGET
    assert all(role == expected_rest for _, role in roles[1:])


def test_rollover_to_a_permanently_broken_identity_keeps_old_replicas_serving() -> None:
    cluster = Cluster(make_spec(2))
    cluster.settle()
    cluster.spec = _rolled(cluster.spec, "revision")
    step = cluster.reconcile()
    (new,) = step.create
    cluster.update(
        new.name,
        node="gpu-9",
        phase="Failed",
        worker=WorkerReport(phase="Failed", permanent_failure=True, message="bad header"),
    )
    for _ in range(3):
        step = cluster.reconcile()
        assert step.delete == {} and step.create == []
        assert cluster.ready_count() == 2
    assert step.status.phase == Phase.FAILED
    assert "bad header" in step.status.message


def test_source_failure_promotes_a_ready_target_and_replaces_the_source() -> None:
    cluster = Cluster(make_spec(3))
    cluster.settle()
    source = next(p for p in cluster.live() if p.role == Role.SOURCE)
    cluster.update(source.name, phase="Failed", failure="Evicted", pod_ready=False)
    step = cluster.reconcile()
    assert source.name in step.delete
    assert step.relabel == {pod_name(NAME, ident(cluster.spec), 1): Role.SOURCE}
    assert "Promoted" in [e.reason for e in step.events]
    (replacement,) = step.create
    assert replacement.role == Role.TARGET and replacement.replica == 3
    assert {p.pod for p in replacement.peers} == {
        pod_name(NAME, ident(cluster.spec), 1),
        pod_name(NAME, ident(cluster.spec), 2),
    }
    final = cluster.settle()
    assert final.status.phase == Phase.READY
    assert sum(p.role == Role.SOURCE for p in cluster.live()) == 1


def test_scale_to_zero_and_back() -> None:
    cluster = Cluster(make_spec(3))
    cluster.settle()
    cluster.spec = make_spec(0)
    down = cluster.reconcile()
    assert len(down.delete) == 3
    assert down.status.ready == "3/0"  # the status reports what it saw: still serving
    assert cluster.live() == []
    gone = cluster.reconcile()
    assert gone.status.ready == "0/0" and gone.status.phase == Phase.READY
    assert gone.delete == {} and gone.create == []
    cluster.spec = make_spec(2)
    final = cluster.settle()
    assert final.status.ready == "2/2"
    assert sorted(p.role for p in cluster.live()) == [Role.SOURCE, Role.TARGET]
