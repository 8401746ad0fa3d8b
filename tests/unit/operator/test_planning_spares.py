"""Warm spares (spec.warmSpares): pods beyond replicas waiting in Standby. Planning keeps k of
them, wakes them first on a scale-up (from zero too), never counts them as replicas, Ready or
sources, and replaces them on a revision change."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests.support.planning import (
    NAME,
    T0,
    Cluster,
    check_plan,
    ident,
    make_spec,
    mkpod,
    observe,
)
from weightlift.api.labels import DEPLOYMENT_LABEL, SPARE_LABEL
from weightlift.api.model import ModelDeploymentSpec, ModelDeploymentStatus, Phase, Role
from weightlift.api.times import rfc3339
from weightlift.api.worker import PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator.planning import (
    POLL_WHILE_LOADING,
    Observed,
    ObservedPod,
    Plan,
    plan,
    pod_name,
)


def spec_of(replicas: int, spares: int, **kw: Any) -> ModelDeploymentSpec:
    return make_spec(replicas, warmSpares=spares, **kw)


def run(spec: ModelDeploymentSpec, observed: Observed) -> Plan:
    result = plan(spec, observed)
    check_plan(observed, result, spec)
    return result


def spare(
    spec: ModelDeploymentSpec, replica: int, state: str = "standby", **kw: Any
) -> ObservedPod:
    """A spare: pending, scheduled, or warm (its worker in Standby)."""
    if state == "standby":
        return mkpod(
            spec,
            replica,
            Role.TARGET,
            state="scheduled",
            phase="Running",
            pod_ip=f"10.0.1.{replica}",
            worker=WorkerReport(phase=WorkerPhase.STANDBY),
            spare=True,
            **kw,
        )
    return mkpod(spec, replica, Role.TARGET, state=state, spare=True, **kw)


def name(spec: ModelDeploymentSpec, replica: int) -> str:
    return pod_name(NAME, ident(spec), replica)


def spares_created(result: Plan) -> list[int]:
    return [d.replica for d in result.create if d.spare]


def serving_created(result: Plan) -> list[tuple[int, Role]]:
    return [(d.replica, d.role) for d in result.create if not d.spare]


def settled(spec: ModelDeploymentSpec) -> Cluster:
    cluster = Cluster(spec)
    cluster.settle()
    return cluster


# ------------------------------------------------------------------------- keeping k spares


def test_a_ready_deployment_keeps_its_spares_waiting_in_standby() -> None:
    cluster = settled(spec_of(1, 1))
    (serving,) = cluster.live()
    (waiting,) = cluster.spares()
    assert serving.inference_ready and serving.role == Role.SOURCE
    assert waiting.in_standby and not waiting.inference_ready and waiting.role == Role.TARGET
    assert waiting.handoff is None, "nothing handed: a spare waits"
    step = cluster.reconcile()
    assert step.create == [] and step.delete == {} and step.handoff == {} and not step.unspare
    status = step.status
    assert status.phase == Phase.READY and status.ready == "1/1"
    assert status.replicas == 1 and status.ready_replicas == 1 and status.spares == 1
    assert status.standby == 0, "a spare is not a target waiting for a source"
    assert [s.pod for s in status.sources] == [serving.name]
    rows = {r.name: r for r in status.replica_statuses}
    assert rows[waiting.name].phase == "Spare" and rows[waiting.name].spare is True
    assert not rows[waiting.name].ready
    assert rows[serving.name].spare is None and rows[serving.name].phase == "Ready"
    assert step.requeue_after == 7.0, "a warm spare needs no polling"


def test_spares_wait_for_the_serving_replicas_to_have_their_nodes() -> None:
    """A spare never takes the GPU a serving replica waits for: spares are created once every
    serving replica is scheduled."""
    spec = spec_of(2, 1)
    first = run(spec, observe())
    assert serving_created(first) == [(0, Role.SOURCE), (1, Role.TARGET)]
    assert spares_created(first) == []
    half = [mkpod(spec, 0, Role.SOURCE, state="scheduled"), mkpod(spec, 1, state="pending")]
    assert spares_created(run(spec, observe(half))) == []
    unschedulable = [half[0], mkpod(spec, 1, state="pending", unschedulable="0/3 nodes: gpu")]
    assert spares_created(run(spec, observe(unschedulable))) == []
    both = [half[0], mkpod(spec, 1, state="scheduled")]
    result = run(spec, observe(both))
    assert spares_created(result) == [2]
    (created,) = result.create
    assert created.role == Role.TARGET and created.peers == [] and created.spare


def test_spare_creation_never_holds_the_phase_back() -> None:
    spec = spec_of(1, 2)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE)]))
    assert spares_created(result) == [1, 2]
    assert result.status.phase == Phase.READY
    assert [c.status for c in result.status.conditions] == ["True"] * 4


def test_zero_replicas_still_keeps_spares() -> None:
    """Scale to zero with warm spares: no serving pod, k spares ready for the first request."""
    spec = spec_of(0, 2)
    result = run(spec, observe())
    assert spares_created(result) == [0, 1] and serving_created(result) == []
    assert result.status.phase == Phase.READY and result.status.ready == "0/0"
    assert result.status.waiting_since is None, "a spare waits for a scale-up, not a source"
    cluster = settled(spec)
    assert cluster.live() == [] and len(cluster.spares()) == 2


def test_a_cold_spare_is_polled_until_it_is_warm() -> None:
    spec = spec_of(1, 1)
    starting = spare(spec, 1, "scheduled", phase="Running", pod_ip="10.0.1.1")
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE), starting]))
    assert result.status.phase == Phase.READY
    assert result.status.spares == 0, "not warm yet"
    assert result.requeue_after == POLL_WHILE_LOADING
    row = next(r for r in result.status.replica_statuses if r.name == starting.name)
    assert row.spare is True and row.phase == "Scheduled"


@pytest.mark.parametrize(("before", "after"), [(3, 1), (3, 0), (2, 1), (1, 0)])
def test_lowering_warm_spares_deletes_spares_never_a_replica(before: int, after: int) -> None:
    spec = spec_of(2, before)
    pods = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1, state="loading")]
    pods += [spare(spec, 2 + i) for i in range(before)]
    result = run(spec_of(2, after), observe(pods))
    spare_names = {p.name for p in pods if p.spare}
    assert set(result.delete) <= spare_names and len(result.delete) == before - after
    assert set(result.delete.values()) == {"warm spare no longer wanted"}
    assert result.create == [] and not result.unspare


def test_a_lowered_count_removes_the_coldest_spares_first() -> None:
    spec = spec_of(1, 3)
    pods = [
        mkpod(spec, 0, Role.SOURCE),
        spare(spec, 1),
        spare(spec, 2, "pending"),
        spare(spec, 3, "scheduled"),
        spare(spec, 4, "failed"),
    ]
    result = run(spec_of(1, 2), observe(pods))
    # The failed one first (it would be replaced anyway), then the unscheduled, then scheduled.
    assert sorted(result.delete) == sorted([name(spec, 4), name(spec, 2)])
    result = run(spec_of(1, 1), observe(pods))
    assert sorted(result.delete) == sorted([name(spec, 4), name(spec, 2), name(spec, 3)])


def test_scale_down_keeps_the_spares() -> None:
    spec = spec_of(1, 1)
    pods = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1), mkpod(spec, 2), spare(spec, 3)]
    result = run(spec, observe(pods))
    assert sorted(result.delete) == sorted([name(spec, 1), name(spec, 2)])
    assert result.create == [] and not result.unspare
    assert result.status.spares == 1


def test_raising_warm_spares_creates_the_missing_ones() -> None:
    spec = spec_of(1, 3)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE), spare(spec, 1)]))
    assert spares_created(result) == [2, 3]


# ------------------------------------------------------------------------- waking on scale-up


def test_scale_up_hands_the_spare_its_peers_and_creates_a_new_spare() -> None:
    spec = spec_of(2, 1)
    source = mkpod(spec, 0, Role.SOURCE)
    waiting = spare(spec, 1)
    result = run(spec, observe([source, waiting]))
    assert result.unspare == {waiting.name}
    handoff = result.handoff[waiting.name]
    assert [p.pod for p in handoff.peers] == [source.name] and not handoff.storage
    assert waiting.name not in result.relabel, "it pulls: still a Target"
    assert serving_created(result) == [], "the spare is the new replica"
    assert spares_created(result) == [2], "a new spare takes its place"
    assert "SpareWoken" in [e.reason for e in result.events]
    status = result.status
    assert status.replicas == 2 and status.ready == "1/2" and status.spares == 0
    assert status.phase == Phase.LOADING
    row = next(r for r in status.replica_statuses if r.name == waiting.name)
    assert row.spare is None and row.phase == WorkerPhase.STANDBY


def test_scale_up_from_zero_hands_the_spare_storage_as_a_source() -> None:
    spec = spec_of(1, 1)
    waiting = spare(spec, 0)
    result = run(spec, observe([waiting]))
    assert result.unspare == {waiting.name}
    assert result.handoff[waiting.name] == PeerHandoff(storage=True)
    assert result.relabel == {waiting.name: Role.SOURCE}
    assert serving_created(result) == [] and spares_created(result) == [1]
    assert result.status.waiting_since is None


def test_scale_up_from_zero_past_initial_sources_the_rest_wait_for_the_source() -> None:
    spec = spec_of(3, 2, initial_sources=1)
    pods = [spare(spec, 0), spare(spec, 1)]
    result = run(spec, observe(pods))
    assert result.unspare == {pods[0].name, pods[1].name}
    assert result.handoff == {pods[0].name: PeerHandoff(storage=True)}
    assert result.relabel == {pods[0].name: Role.SOURCE}
    # The second spare waits for the source as a standby Target; one more replica is created.
    assert serving_created(result) == [(2, Role.TARGET)]
    assert spares_created(result) == [], "not before the new replica has its node"
    assert result.status.waiting_since == rfc3339(T0)
    assert "1 replica(s) in standby" not in result.status.message  # 2: the spare and the new one
    assert "2 replica(s) in standby wait" in result.status.message


@pytest.mark.parametrize("initial", [1, 2])
def test_initial_sources_decide_how_many_woken_spares_load_from_storage(initial: int) -> None:
    spec = spec_of(2, 2, initial_sources=initial)
    result = run(spec, observe([spare(spec, 0), spare(spec, 1)]))
    storage = sorted(n for n, h in result.handoff.items() if h.storage)
    assert len(storage) == initial and len(result.unspare) == 2


def test_a_scale_up_larger_than_the_spares_wakes_them_all_then_creates_replicas() -> None:
    spec = spec_of(4, 2)
    source = mkpod(spec, 0, Role.SOURCE)
    pods = [source, spare(spec, 1), spare(spec, 2)]
    result = run(spec, observe(pods))
    assert result.unspare == {pods[1].name, pods[2].name}
    assert serving_created(result) == [(3, Role.TARGET)]
    (created,) = result.create
    assert [p.pod for p in created.peers] == [source.name]
    assert spares_created(result) == []


def test_warm_spares_are_woken_before_cold_ones() -> None:
    spec = spec_of(2, 3)
    pods = [
        mkpod(spec, 0, Role.SOURCE),
        spare(spec, 1, "pending"),
        spare(spec, 2, "scheduled"),
        spare(spec, 3),
    ]
    result = run(spec, observe(pods))
    assert result.unspare == {name(spec, 3)}
    result = run(spec_of(3, 3), observe(pods))
    assert result.unspare == {name(spec, 3), name(spec, 2)}


def test_a_failed_spare_is_never_woken() -> None:
    spec = spec_of(2, 1)
    broken = spare(spec, 1, "failed", failed_at=T0)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE), broken]))
    assert not result.unspare
    assert broken.name in result.delete, "replaced"
    assert serving_created(result) == [(2, Role.TARGET)]


def test_a_woken_spare_waits_for_a_source_that_is_still_loading() -> None:
    spec = spec_of(2, 1)
    loading = mkpod(spec, 0, Role.SOURCE, state="loading")
    waiting = spare(spec, 1)
    result = run(spec, observe([loading, waiting]))
    assert result.unspare == {waiting.name} and result.handoff == {}
    assert result.status.waiting_since == rfc3339(T0)


def test_a_woken_spare_gets_storage_once_the_wait_ran_out() -> None:
    spec = spec_of(2, 1, wait=60)
    loading = mkpod(spec, 0, Role.SOURCE, state="loading")
    previous = ModelDeploymentStatus(waiting_since=rfc3339(T0 - timedelta(seconds=61)))
    result = run(spec, observe([loading, spare(spec, 1)], previous=previous))
    assert result.handoff == {name(spec, 1): PeerHandoff(storage=True)}
    assert result.relabel == {name(spec, 1): Role.SOURCE}


def test_a_failed_replica_is_replaced_by_a_spare() -> None:
    spec = spec_of(2, 1)
    pods = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1, state="failed"), spare(spec, 2)]
    result = run(spec, observe(pods))
    assert name(spec, 1) in result.delete
    assert result.unspare == {name(spec, 2)}
    assert [p.pod for p in result.handoff[name(spec, 2)].peers] == [name(spec, 0)]
    assert serving_created(result) == [] and spares_created(result) == [3]


def test_spares_are_never_ready_sources_or_replicas() -> None:
    """Even a spare that somehow passes its probe is not Ready: it is not a replica."""
    spec = spec_of(1, 1)
    odd = mkpod(spec, 1, state="ready", spare=True)
    assert not odd.inference_ready
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE), odd]))
    assert result.status.ready_replicas == 1 and result.status.replicas == 1
    assert [s.pod for s in result.status.sources] == [name(spec, 0)]


def test_the_scale_selector_leaves_spares_out() -> None:
    spec = spec_of(1, 1)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE), spare(spec, 1)]))
    assert result.status.selector == f"{DEPLOYMENT_LABEL}={NAME},!{SPARE_LABEL}"
    assert result.status.replicas == 1


def test_a_spare_alone_is_no_source_for_a_scale_up_of_another_deployment() -> None:
    """A spare is never published: siblings see only Ready replicas."""
    spec = spec_of(0, 2)
    result = run(spec, observe([spare(spec, 0), spare(spec, 1)]))
    assert result.status.sources == [] and result.status.ready_sources == 0


# ------------------------------------------------------------------------- revision changes


def test_a_revision_change_replaces_the_spares_and_never_wakes_an_old_one() -> None:
    old_spec = spec_of(1, 2)
    pods = [mkpod(old_spec, 0, Role.SOURCE), spare(old_spec, 1), spare(old_spec, 2)]
    new_spec = spec_of(2, 2, revision="v2")
    result = run(new_spec, observe(pods))
    assert {name(old_spec, 1), name(old_spec, 2)} <= set(result.delete)
    assert not result.unspare and not result.handoff, "no old spare serves"
    assert name(old_spec, 0) not in result.delete, "the old replica serves until replaced"
    # The new identity's replicas first; its spares once they have nodes.
    assert [d.identity for d in result.create] == [ident(new_spec)] * len(result.create)
    assert spares_created(result) == []


def test_rollover_with_spares_ends_with_new_spares_only() -> None:
    cluster = settled(spec_of(2, 1))
    old = {p.name for p in cluster.spares()}
    cluster.spec = spec_of(2, 1, revision="v2")

    def no_old_spare_served(c: Cluster) -> None:
        for p in c.pods.values():
            if p.name in old:
                assert p.spare and p.handoff is None, "an old spare was handed something"

    cluster.settle(on_step=no_old_spare_served)
    assert {p.identity for p in [*cluster.live(), *cluster.spares()]} == {ident(cluster.spec)}
    assert len(cluster.spares()) == 1 and len(cluster.live()) == 2
    assert not old & set(cluster.pods)


# ------------------------------------------------------------------------- sequences


def test_scale_up_is_served_by_the_spares_own_pod() -> None:
    cluster = settled(spec_of(1, 1))
    (waiting,) = cluster.spares()
    cluster.spec = spec_of(2, 1)
    step = cluster.reconcile()
    assert step.unspare == {waiting.name}
    final = cluster.settle()
    assert final.status.phase == Phase.READY and final.status.ready == "2/2"
    serving = {p.name: p for p in cluster.live()}
    assert waiting.name in serving and serving[waiting.name].inference_ready
    assert serving[waiting.name].handoff is not None and serving[waiting.name].handoff.peers
    (new,) = cluster.spares()
    assert new.name != waiting.name and new.in_standby
    assert final.status.replicas == 2 and final.status.spares == 1


def test_scale_up_from_zero_is_served_by_a_spare() -> None:
    cluster = settled(spec_of(0, 1))
    (waiting,) = cluster.spares()
    cluster.spec = spec_of(1, 1)
    final = cluster.settle()
    (serving,) = cluster.live()
    assert serving.name == waiting.name and serving.role == Role.SOURCE
    assert serving.handoff == PeerHandoff(storage=True)
    assert final.status.ready == "1/1" and len(cluster.spares()) == 1


@pytest.mark.parametrize("spares", [1, 2, 3])
@pytest.mark.parametrize(("start", "steps"), [(1, [3, 1, 4, 0, 2]), (0, [2, 5, 1])])
def test_the_spare_count_stays_k_through_scaling(spares: int, start: int, steps: list[int]) -> None:
    cluster = settled(spec_of(start, spares))
    for replicas in steps:
        before, serving = {p.name for p in cluster.spares()}, len(cluster.live())
        cluster.spec = spec_of(replicas, spares)
        final = cluster.settle()
        assert len(cluster.live()) == replicas == final.status.ready_replicas
        assert len(cluster.spares()) == spares == final.status.spares
        assert all(p.in_standby for p in cluster.spares())
        # A scale-up is served by spares first: they serve now, as many as it needed.
        woken = before & {p.name for p in cluster.live()}
        assert len(woken) == min(spares, max(0, replicas - serving))
