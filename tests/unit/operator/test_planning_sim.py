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


def test_cold_start_targets_wait_until_the_source_passes_its_probe() -> None:
    cluster = Cluster(make_spec(3))
    first = cluster.reconcile()
    assert [(d.replica, d.role) for d in first.create] == [(0, Role.SOURCE)]
    assert first.status.waiting_since is not None
    source = first.create[0].name
    for _ in range(3):  # scheduled, running, loaded (probe not yet passed)
        cluster.advance(source)
        step = cluster.reconcile()
        assert step.create == [], "targets must wait for a Ready source"
        assert step.status.waiting_since == first.status.waiting_since
        assert step.status.sources == []
    cluster.advance(source)  # probe passes
    step = cluster.reconcile()
    assert [(d.replica, d.role) for d in step.create] == [(1, Role.TARGET), (2, Role.TARGET)]
    assert all([p.pod for p in d.peers] == [source] for d in step.create)
    assert step.status.waiting_since is None
    assert [s.pod for s in step.status.sources] == [source]


def test_wait_for_source_expiry_loads_remaining_replicas_from_storage() -> None:
    cluster = Cluster(make_spec(3, wait=60))
    first = cluster.reconcile()
    cluster.now += timedelta(seconds=59)
    early = cluster.reconcile()
    assert early.create == []
    assert early.requeue_after <= 1.0
    cluster.now += timedelta(seconds=2)
    late = cluster.reconcile()
    assert [(d.replica, d.role) for d in late.create] == [(1, Role.SOURCE), (2, Role.SOURCE)]
    assert "WaitForSourceExpired" in [e.reason for e in late.events]
    assert late.status.waiting_since is None
    assert first.status.waiting_since is not None


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
