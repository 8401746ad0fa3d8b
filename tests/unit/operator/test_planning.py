"""Planning, one reconcile at a time: roles, waiting, promotion, scaling, rollover, failures,
sibling sources, invalid and unparsable specs, status and conditions."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from tests.support.planning import (
    NAME,
    PROBE_REQUEST,
    T0,
    check_plan,
    ident,
    make_spec,
    mkpod,
    observe,
    sibling,
)
from weightlift.api.labels import DEPLOYMENT_LABEL, SPARE_LABEL
from weightlift.api.model import (
    Condition,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    Role,
)
from weightlift.api.times import rfc3339
from weightlift.api.worker import WorkerReport
from weightlift.operator.planning import (
    POLL_PENDING,
    POLL_WHILE_LOADING,
    Observed,
    Plan,
    SpecError,
    plan,
    pod_name,
    validate,
)


def run(spec: ModelDeploymentSpec, observed: Observed) -> Plan:
    result = plan(spec, observed)
    check_plan(observed, result, spec)
    return result


def roles(result: Plan) -> list[tuple[int, Role]]:
    return [(d.replica, d.role) for d in result.create]


def standby(result: Plan) -> list[int]:
    """Replicas created as Targets without peers: they start and wait in Standby."""
    return [d.replica for d in result.create if d.role == Role.TARGET and not d.peers]


def reasons(result: Plan) -> list[str]:
    return [e.reason for e in result.events]


def condition(result: Plan, ctype: str) -> Condition:
    return next(c for c in result.status.conditions if c.type == ctype)


SPEC = make_spec(3)
ID = ident(SPEC)


# -------------------------------------------------------------------------- roles, waiting


@pytest.mark.parametrize("initial", [1, 2, 3])
def test_first_initial_sources_load_from_storage_the_rest_start_in_standby(initial: int) -> None:
    spec = make_spec(4, initial_sources=initial)
    result = run(spec, observe())
    assert roles(result) == [(i, Role.SOURCE) for i in range(initial)] + [
        (i, Role.TARGET) for i in range(initial, 4)
    ]
    assert standby(result) == list(range(initial, 4))
    assert all(d.peers == [] for d in result.create)
    assert result.status.waiting_since == rfc3339(T0)
    assert result.status.sources == []
    assert result.status.phase == Phase.PENDING  # nothing scheduled yet
    assert result.status.message == "waiting for worker pods to be scheduled"


def test_no_waiting_when_initial_sources_cover_all_replicas() -> None:
    result = run(make_spec(2, initial_sources=2), observe())
    assert roles(result) == [(0, Role.SOURCE), (1, Role.SOURCE)]
    assert result.status.waiting_since is None


def test_standby_targets_wait_while_the_only_source_is_probing() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loaded")]
    pods += [mkpod(SPEC, i, Role.TARGET, state="loading") for i in (1, 2)]
    result = run(SPEC, observe(pods))
    assert result.create == [] and result.handoff == {}, "a source not yet probed is no source"
    assert result.status.phase == Phase.LOADING
    assert "2 replica(s) in standby wait" in result.status.message
    assert result.status.waiting_since == rfc3339(T0)


def test_loading_phase_mentions_waiting_replicas() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    result = run(SPEC, observe(pods))
    assert standby(result) == [1, 2]
    assert result.status.phase == Phase.LOADING
    assert "2 replica(s) in standby wait for a Ready source" in result.status.message


@pytest.mark.parametrize("state", ["pending", "scheduled", "loading", "loaded", "probe-failed"])
def test_a_source_that_is_not_inference_ready_makes_others_wait(state: str) -> None:
    result = run(SPEC, observe([mkpod(SPEC, 0, Role.SOURCE, state=state)]))
    assert standby(result) == [1, 2] and len(result.create) == 2
    assert result.status.sources == []
    assert result.status.ready_sources == 0
    assert result.status.waiting_since is not None


def test_ready_source_turns_waiting_replicas_into_targets_with_candidates() -> None:
    previous = ModelDeploymentStatus(waiting_since=rfc3339(T0 - timedelta(seconds=30)))
    pods = [mkpod(SPEC, 0, Role.SOURCE)]
    result = run(SPEC, observe(pods, previous=previous))
    assert roles(result) == [(1, Role.TARGET), (2, Role.TARGET)]
    for desired in result.create:
        (peer,) = desired.peers
        assert peer.pod == pods[0].name
        assert peer.address == "10.0.0.10:8000"
        assert peer.model_identity == ID
        assert peer.deployment == NAME
        assert peer.ranks == [0]
    assert result.status.waiting_since is None
    assert [s.pod for s in result.status.sources] == [pods[0].name]
    assert result.status.ready_sources == 1
    assert "WaitForSourceExpired" not in reasons(result)


def test_targets_get_every_ready_source_in_replica_order() -> None:
    spec = make_spec(4, initial_sources=2)
    pods = [mkpod(spec, 1, Role.SOURCE), mkpod(spec, 0, Role.SOURCE)]
    result = run(spec, observe(pods))
    assert roles(result) == [(2, Role.TARGET), (3, Role.TARGET)]
    assert [p.pod for p in result.create[0].peers] == [
        pod_name(NAME, ident(spec), 0),
        pod_name(NAME, ident(spec), 1),
    ]


def test_tensor_parallel_sources_advertise_every_rank() -> None:
    spec = make_spec(2, tensor=4)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE)]))
    assert result.create[0].peers[0].ranks == [0, 1, 2, 3]


def test_ready_pod_without_ip_is_not_a_source() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, pod_ip=None)]
    result = run(SPEC, observe(pods))
    assert standby(result) == [1, 2]
    assert result.status.sources == []


def test_waiting_since_is_kept_across_reconciles() -> None:
    since = rfc3339(T0 - timedelta(seconds=100))
    previous = ModelDeploymentStatus(waiting_since=since)
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    pods += [mkpod(SPEC, i, Role.TARGET, state="loading") for i in (1, 2)]
    result = run(SPEC, observe(pods, previous=previous))
    assert result.status.waiting_since == since
    assert result.create == [] and result.handoff == {}
    # Next look no later than when the wait runs out (200 s left), here the loading poll.
    assert result.requeue_after == POLL_WHILE_LOADING


def test_requeue_wakes_up_when_the_wait_runs_out() -> None:
    since = rfc3339(T0 - timedelta(seconds=299))
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    result = run(SPEC, observe(pods, previous=ModelDeploymentStatus(waiting_since=since)))
    assert 0 < result.requeue_after <= 1.0


def test_expired_wait_loads_from_storage_and_says_so() -> None:
    since = rfc3339(T0 - timedelta(seconds=301))
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    # Missing replicas are created as storage sources; the ones in standby are handed storage.
    result = run(SPEC, observe(pods, previous=ModelDeploymentStatus(waiting_since=since)))
    assert roles(result) == [(1, Role.SOURCE), (2, Role.SOURCE)]
    assert all(d.peers == [] for d in result.create)
    assert result.status.waiting_since is None
    pods += [mkpod(SPEC, i, Role.TARGET, state="loading") for i in (1, 2)]
    result = run(SPEC, observe(pods, previous=ModelDeploymentStatus(waiting_since=since)))
    assert result.create == []
    assert {n: h.storage for n, h in result.handoff.items()} == {p.name: True for p in pods[1:]}
    assert result.relabel == {p.name: Role.SOURCE for p in pods[1:]}
    assert "WaitForSourceExpired" in reasons(result)
    assert result.status.waiting_since is None


def test_zero_wait_means_no_waiting_at_all() -> None:
    result = run(make_spec(3, wait=0), observe())
    assert roles(result) == [(0, Role.SOURCE), (1, Role.SOURCE), (2, Role.SOURCE)]
    assert result.status.waiting_since is None
    assert "WaitForSourceExpired" not in reasons(result)


def test_garbage_waiting_since_restarts_the_wait_instead_of_crashing() -> None:
    previous = ModelDeploymentStatus(waiting_since="yesterday-ish")
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    result = run(SPEC, observe(pods, previous=previous))
    assert standby(result) == [1, 2]
    assert result.status.waiting_since == rfc3339(T0)


def test_naive_now_is_taken_as_utc() -> None:
    since = rfc3339(T0 - timedelta(seconds=301))
    naive = datetime(2026, 1, 1, 12, 0, 0)
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading")]
    result = run(
        SPEC, observe(pods, now=naive, previous=ModelDeploymentStatus(waiting_since=since))
    )
    assert roles(result) == [(1, Role.SOURCE), (2, Role.SOURCE)]


@pytest.mark.parametrize("strategy", ["Preload", "Direct"])
def test_storage_strategies_make_every_replica_a_source_without_waiting(strategy: str) -> None:
    spec = make_spec(3, strategy=strategy)
    first = run(spec, observe())
    assert roles(first) == [(0, Role.SOURCE), (1, Role.SOURCE), (2, Role.SOURCE)]
    assert first.status.waiting_since is None
    # Even with a Ready source around, new replicas load from storage.
    more = run(
        make_spec(5, strategy=strategy), observe([mkpod(spec, i, Role.SOURCE) for i in range(3)])
    )
    assert roles(more) == [(3, Role.SOURCE), (4, Role.SOURCE)]
    assert all(d.peers == [] for d in more.create)


def test_external_runtime_replicas_all_load_from_storage() -> None:
    external = {"type": "External", "command": ["tritonserver"]}
    spec = make_spec(3, runtime=external)
    with_source = observe([mkpod(spec, 0, Role.SOURCE)])
    assert roles(run(spec, with_source)) == [(1, Role.SOURCE), (2, Role.SOURCE)]
    assert roles(run(make_spec(3), with_source)) == [(1, Role.TARGET), (2, Role.TARGET)]


def test_peer_to_peer_strategy_waits_like_auto() -> None:
    spec = make_spec(3, strategy="PeerToPeer")
    first = run(spec, observe())
    assert roles(first) == [(0, Role.SOURCE), (1, Role.TARGET), (2, Role.TARGET)]
    assert standby(first) == [1, 2]
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE)]))
    assert roles(result) == [(1, Role.TARGET), (2, Role.TARGET)]


# --------------------------------------------------------------------------------- siblings


def test_sibling_deployment_with_the_same_identity_counts_as_a_source() -> None:
    friend = sibling(ID)
    result = run(SPEC, observe(siblings=[friend]))
    assert roles(result) == [(0, Role.TARGET), (1, Role.TARGET), (2, Role.TARGET)]
    assert all(d.peers == [friend] for d in result.create)
    assert result.status.waiting_since is None
    # status.sources lists only this deployment's own replicas.
    assert result.status.sources == [] and result.status.ready_sources == 0


def test_sibling_with_another_identity_does_not_count() -> None:
    result = run(SPEC, observe(siblings=[sibling("0123456789abcdef")]))
    assert roles(result)[0] == (0, Role.SOURCE) and standby(result) == [1, 2]
    assert result.status.waiting_since is not None


def test_own_stale_entry_in_sibling_list_is_ignored() -> None:
    stale = sibling(ID, pod=pod_name(NAME, ID, 0), deployment=NAME)
    result = run(SPEC, observe(siblings=[stale]))
    assert roles(result)[0] == (0, Role.SOURCE) and standby(result) == [1, 2]


def test_own_and_sibling_sources_are_both_candidates() -> None:
    friend = sibling(ID)
    result = run(SPEC, observe([mkpod(SPEC, 0, Role.SOURCE)], siblings=[friend]))
    assert [p.pod for p in result.create[0].peers] == [pod_name(NAME, ID, 0), friend.pod]
    assert [s.pod for s in result.status.sources] == [pod_name(NAME, ID, 0)]


# -------------------------------------------------------------------------------- promotion


def test_lowest_ready_target_is_promoted_when_no_source_is_left() -> None:
    pods = [
        mkpod(SPEC, 2, Role.TARGET),
        mkpod(SPEC, 1, Role.TARGET),
        mkpod(SPEC, 3, Role.TARGET, state="loading"),
    ]
    result = run(make_spec(4), observe(pods))
    assert result.relabel == {pods[1].name: Role.SOURCE}
    promoted = [e for e in result.events if e.reason == "Promoted"]
    assert len(promoted) == 1 and pods[1].name in promoted[0].message
    # The missing replica 0 comes back as a target of the Ready ones.
    assert roles(result) == [(0, Role.TARGET)]


def test_no_promotion_while_a_source_role_replica_exists() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="loading"), mkpod(SPEC, 1, Role.TARGET)]
    result = run(SPEC, observe(pods))
    assert result.relabel == {}
    assert "Promoted" not in reasons(result)


def test_no_promotion_without_a_ready_target() -> None:
    pods = [
        mkpod(SPEC, 1, Role.TARGET, state="loading"),
        mkpod(SPEC, 2, Role.TARGET, state="loaded"),
    ]
    result = run(SPEC, observe(pods))
    assert result.relabel == {}
    # Nobody can feed the missing replica: it loads from storage.
    assert roles(result) == [(0, Role.SOURCE)]


def test_failed_source_is_replaced_and_a_target_promoted() -> None:
    pods = [
        mkpod(SPEC, 0, Role.SOURCE, state="failed"),
        mkpod(SPEC, 1, Role.TARGET),
        mkpod(SPEC, 2, Role.TARGET),
    ]
    result = run(SPEC, observe(pods))
    assert pods[0].name in result.delete
    assert "OOMKilled" in result.delete[pods[0].name]
    assert result.relabel == {pods[1].name: Role.SOURCE}
    assert roles(result) == [(3, Role.TARGET)]  # name of the dying pod is still taken
    assert {p.pod for p in result.create[0].peers} == {pods[1].name, pods[2].name}


def test_permanently_failed_source_does_not_block_promotion() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="broken"), mkpod(SPEC, 1, Role.TARGET)]
    result = run(make_spec(2), observe(pods))
    assert result.relabel == {pods[1].name: Role.SOURCE}
    assert result.delete == {}


# ---------------------------------------------------------------------------------- scaling


def test_scale_up_adds_targets_of_the_ready_sources() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE)]
    result = run(make_spec(3), observe(pods))
    assert roles(result) == [(1, Role.TARGET), (2, Role.TARGET)]
    assert result.delete == {}


def test_scale_up_fills_the_lowest_free_indices() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 2, Role.TARGET)]
    result = run(make_spec(4), observe(pods))
    assert [d.replica for d in result.create] == [1, 3]


def test_terminating_pods_keep_their_names_taken() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, state="terminating")]
    result = run(make_spec(2), observe(pods))
    assert [d.replica for d in result.create] == [2]


def test_names_are_unique_even_when_identities_share_a_prefix() -> None:
    other = ID[:6] + "f" * 10  # another identity, same 6-character prefix in pod names
    assert other != ID
    pods = [mkpod(other, 0, Role.SOURCE, state="loading")]
    assert pods[0].name == pod_name(NAME, ID, 0)
    result = run(make_spec(1), observe(pods))
    assert [d.replica for d in result.create] == [1]


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [
        (4, ["t2"]),  # not-ready first
        (3, ["t2", "t4"]),  # then targets, highest index first
        (2, ["t2", "t4", "t3"]),
        (1, ["t2", "t4", "t3", "t1"]),  # then sources
        (0, ["t2", "t4", "t3", "t1", "s0"]),
    ],
)
def test_scale_down_order(replicas: int, expected: list[str]) -> None:
    named = {
        "s0": mkpod(SPEC, 0, Role.SOURCE),
        "t1": mkpod(SPEC, 1, Role.TARGET),
        "t2": mkpod(SPEC, 2, Role.TARGET, state="loading"),
        "t3": mkpod(SPEC, 3, Role.TARGET),
        "t4": mkpod(SPEC, 4, Role.TARGET),
    }
    result = run(make_spec(replicas), observe(list(named.values())))
    assert set(result.delete) == {named[k].name for k in expected}
    assert all(reason == "scaled down" for reason in result.delete.values())
    assert result.create == []


def test_scale_down_removes_the_extra_source_with_the_highest_index() -> None:
    spec = make_spec(1, initial_sources=2)
    pods = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1, Role.SOURCE)]
    result = run(spec, observe(pods))
    assert set(result.delete) == {pods[1].name}
    assert [s.pod for s in result.status.sources] == [pods[0].name]


def test_scale_down_keeps_the_last_source_while_a_target_loads() -> None:
    pods = [
        mkpod(SPEC, 0, Role.SOURCE),
        mkpod(SPEC, 1, Role.TARGET, state="loading"),
        mkpod(SPEC, 2, Role.TARGET, state="loading"),
    ]
    result = run(make_spec(2), observe(pods))
    assert pods[0].name not in result.delete
    assert set(result.delete) == {pods[2].name}
    assert [s.pod for s in result.status.sources] == [pods[0].name]


def test_scale_down_removes_permanent_failures_first() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, state="broken")]
    result = run(make_spec(1), observe(pods))
    assert set(result.delete) == {pods[1].name}
    assert result.status.phase == Phase.READY


def test_scaled_down_sources_are_not_published_or_offered() -> None:
    spec = make_spec(1, initial_sources=2)
    pods = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1, Role.SOURCE)]
    result = run(spec, observe(pods))
    assert all(s.pod not in result.delete for s in result.status.sources)
    assert result.status.ready_sources == 1


# --------------------------------------------------------------------------------- rollover


NEW = make_spec(3, revision="v2")
NEW_ID = ident(NEW)


def test_identity_change_creates_max_surge_new_replicas_and_keeps_old_ready_ones() -> None:
    old = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET), mkpod(SPEC, 2, Role.TARGET)]
    result = run(NEW, observe(old))
    assert result.delete == {}
    assert [(d.replica, d.role, d.identity) for d in result.create] == [(0, Role.SOURCE, NEW_ID)]
    assert result.status.ready == "3/3"
    assert result.status.updated_replicas == 0
    assert result.status.phase != Phase.READY
    assert result.status.model_identity == NEW_ID
    # Old replicas are no source for the new identity.
    assert result.status.sources == []


def test_rollover_deletes_old_replicas_that_are_not_ready_right_away() -> None:
    old = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, state="loading")]
    result = run(make_spec(2, revision="v2"), observe(old))
    assert set(result.delete) == {old[1].name}
    assert "superseded" in result.delete[old[1].name]
    # Within maxSurge (1 old left + 2 new = 3): a storage source and a target in standby.
    assert roles(result) == [(0, Role.SOURCE), (1, Role.TARGET)]
    assert standby(result) == [1]


def test_rollover_retires_one_old_target_per_new_ready_replica() -> None:
    old = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET), mkpod(SPEC, 2, Role.TARGET)]
    new = [mkpod(NEW, 0, Role.SOURCE)]
    result = run(NEW, observe(old + new))
    assert set(result.delete) == {old[2].name}
    assert result.delete[old[2].name] == "rolled over to the new model identity"
    assert roles(result) == [(1, Role.TARGET)]
    assert [p.pod for p in result.create[0].peers] == [new[0].name]


def test_rollover_retires_all_old_once_enough_new_are_ready() -> None:
    old = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET)]
    spec = make_spec(2, revision="v2")
    new = [mkpod(spec, 0, Role.SOURCE), mkpod(spec, 1, Role.TARGET)]
    result = run(spec, observe(old + new))
    assert set(result.delete) == {p.name for p in old}
    assert result.create == []


def test_rollover_with_larger_surge() -> None:
    old = [mkpod(SPEC, i, Role.SOURCE if i == 0 else Role.TARGET) for i in range(3)]
    result = run(make_spec(3, revision="v2", max_surge=3, wait=0), observe(old))
    assert len(result.create) == 3


def test_surge_counts_old_and_new_replicas_together() -> None:
    old = [mkpod(SPEC, i, Role.TARGET) for i in range(3)]
    new = [mkpod(NEW, 0, Role.SOURCE, state="loading")]
    result = run(NEW, observe(old + new))
    assert result.create == []  # 3 old + 1 new = replicas + maxSurge
    assert result.delete == {}


# --------------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "overrides",
    [
        {"phase": "Failed", "failure": "OOMKilled"},
        {"phase": "Succeeded"},
        {"phase": "Running", "worker": WorkerReport(phase="Failed", message="peer went away")},
    ],
)
def test_transient_failures_are_replaced(overrides: dict[str, Any]) -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, **overrides)]
    result = run(make_spec(2), observe(pods))
    assert set(result.delete) == {pods[1].name}
    assert result.delete[pods[1].name].startswith("replacing failed replica")
    assert roles(result) == [(2, Role.TARGET)]


def test_permanent_failure_is_kept_with_the_workers_message() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, state="broken")]
    result = run(make_spec(2), observe(pods))
    assert result.delete == {} and result.create == []
    assert result.status.phase == Phase.FAILED
    assert "undefined symbol triton_pytorch_model_init" in result.status.message
    assert pods[1].name in result.status.message
    entry = next(r for r in result.status.replica_statuses if r.name == pods[1].name)
    assert entry.phase == "Failed"
    assert "undefined symbol" in entry.message
    ready = condition(result, "Ready")
    assert ready.status == "False" and ready.reason == "Failed"
    assert ("Warning", "PhaseFailed") in [(e.type, e.reason) for e in result.events]


def test_permanent_failure_does_not_poll_fast() -> None:
    spec = make_spec(1)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE, state="broken")]))
    assert result.requeue_after == 7.0  # the probe period, not the loading poll


def test_failed_replica_status_uses_the_container_reason_without_a_report() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET, state="failed")]
    result = run(make_spec(2), observe(pods))
    entry = next(r for r in result.status.replica_statuses if r.name == pods[1].name)
    assert entry.phase == "Failed" and entry.message == "OOMKilled"


# ------------------------------------------------------------------------------ bad input


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"uri": "s3:///"}, "spec.model.uri"),
    ({"uri": "hf://@v1"}, "spec.model.uri"),
    ({"uri": "hf://meta/llama@v2", "revision": "v1"}, "spec.model.revision"),
    (
        {"model": {"uri": "pvc://models/llama", "credentials": {"name": "s3"}}},
        "spec.model.credentials",
    ),
    (
        {"model": {"uri": "hostpath:///models/m", "endpoint": "http://minio:9000"}},
        "spec.model.endpoint",
    ),
    ({"model": {"uri": "hf://meta/llama", "region": "eu-west-1"}}, "spec.model.region"),
    ({"uri": "pvc://models"}, "spec.model.uri"),
    ({"uri": "pvc://models/"}, "spec.model.uri"),
    ({"uri": "pvc:///llama"}, "spec.model.uri"),
    # hostpath:// and file:// only below the allowed prefixes (observe(): /models)
    ({"uri": "hostpath:///"}, "spec.model.uri"),
    ({"uri": "hostpath:///etc"}, "spec.model.uri"),
    ({"uri": "hostpath:///models/../etc"}, "spec.model.uri"),
    ({"uri": "hostpath:///models-other/llama"}, "spec.model.uri"),
    ({"uri": "hostpath:///dev/null"}, "spec.model.uri"),
    ({"uri": "file:///etc/passwd"}, "spec.model.uri"),
    ({"tensor": 16}, "spec.parallelism.tensor"),
    # Multi-pod replicas run the builtin runtime only, and no warm spares (yet).
    (
        {
            "parallelism": {"tensor": 2, "podsPerReplica": 2},
            "runtime": {"type": "External", "command": ["srv"]},
        },
        "spec.parallelism.podsPerReplica",
    ),
    ({"parallelism": {"tensor": 2, "podsPerReplica": 2}, "warmSpares": 1}, "spec.warmSpares"),
    ({"parallelism": {"pipeline": 2}}, "spec.parallelism.pipeline"),
    ({"initHooks": {"library": "/usr/lib/libevil.so"}}, "spec.initHooks.library"),
    ({"initHooks": {"library": "../libx.so"}}, "spec.initHooks.library"),
    ({"initHooks": {"library": "hooks/../../libx.so"}}, "spec.initHooks.library"),
    ({"probe": {"request": {"parameters": {}}}}, "spec.probe.request"),
    ({"probe": {"request": {"inputs": {"x": 1}}}}, "spec.probe.request"),
    ({"probe": {"request": {"inputs": []}}}, "spec.probe.request"),
]


def _spec_with(changes: dict[str, Any]) -> ModelDeploymentSpec:
    kwargs: dict[str, Any] = {"replicas": 3}
    extra: dict[str, Any] = {}
    for key, value in changes.items():
        if key in ("uri", "tensor", "probe", "revision"):
            kwargs[key] = value
        else:
            extra[key] = value
    return make_spec(**kwargs, **extra)


@pytest.mark.parametrize(("changes", "field"), INVALID)
def test_invalid_spec_fails_without_touching_pods(changes: dict[str, Any], field: str) -> None:
    spec = _spec_with(changes)
    identity = ident(spec)
    pods = [
        mkpod(identity, 0, Role.SOURCE),
        mkpod(identity, 1, Role.TARGET, state="failed"),
        mkpod("0123456789abcdef", 0, Role.SOURCE),  # an old identity too
    ]
    result = run(spec, observe(pods))
    assert result.create == [] and result.delete == {} and result.relabel == {}
    assert result.status.phase == Phase.FAILED
    assert result.status.message.startswith(field)
    ready = condition(result, "Ready")
    assert (ready.status, ready.reason) == ("False", "InvalidSpec")
    assert ready.message.startswith(field)
    warnings = [e for e in result.events if e.reason == "InvalidSpec"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert validate(spec, observe(pods)) == result.status.message
    # Repeating the same reconcile does not repeat the warning event.
    again = run(spec, observe(pods, previous=result.status))
    assert "InvalidSpec" not in reasons(again)
    assert condition(again, "Ready").last_transition_time == ready.last_transition_time


def test_invalid_spec_keeps_publishing_ready_sources() -> None:
    spec = make_spec(2, uri="s3:///")
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE)]))
    assert [s.pod for s in result.status.sources] == [pod_name(NAME, ident(spec), 0)]


def test_an_unparsable_spec_fails_and_keeps_what_the_status_said() -> None:
    """observe hands plan() the parse error: plan decides the status, touches no pod, keeps the
    replicas and sources the last good pass saw (they keep serving), warns once."""
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET)]
    good = run(SPEC, observe(pods))
    error = SpecError("spec.replicas: Input should be a valid integer")
    later = T0 + timedelta(seconds=5)
    result = plan(error, observe(pods, previous=good.status, now=later, generation=4))
    assert result.create == [] and result.delete == {} and result.relabel == {}
    status = result.status
    assert (status.phase, status.message) == (Phase.FAILED, error.message)
    assert status.observed_generation == 4
    assert status.sources == good.status.sources and status.sources
    assert status.replica_statuses == good.status.replica_statuses
    ready = condition(result, "Ready")
    assert (ready.status, ready.reason, ready.message) == ("False", "InvalidSpec", error.message)
    assert ready.last_transition_time == rfc3339(later)
    assert condition(result, "Scheduled") == condition(good, "Scheduled")
    assert [(e.type, e.reason, e.message) for e in result.events] == [
        ("Warning", "InvalidSpec", error.message)
    ]
    # The same problem on the next pass: no second Event, the transition time stays.
    again = plan(error, observe(pods, previous=status, now=later + timedelta(seconds=30)))
    assert again.events == []
    assert condition(again, "Ready").last_transition_time == ready.last_transition_time
    # A different problem is a new transition.
    other = plan(SpecError("spec.model: Field required"), observe(pods, previous=status))
    assert reasons(other) == ["InvalidSpec"]


def test_an_unparsable_spec_on_the_first_pass_still_gets_a_status() -> None:
    result = plan(SpecError("spec.model: Field required"), observe())
    assert result.status.phase == Phase.FAILED
    assert [c.type for c in result.status.conditions] == ["Ready"]
    assert reasons(result) == ["InvalidSpec"]


@pytest.mark.parametrize(
    "changes",
    [
        {"uri": "hostpath:///models/llama"},
        {"uri": "file:///models/llama"},
        {"uri": "pvc://models/llama/v1"},
        {"uri": "pvc:///models/llama"},  # what pods.model_mount reads as claim "models"
        {"uri": "s3://bucket/llama"},
        {"uri": "hf://meta/llama"},
        {"uri": "hf://meta/llama@0123abc"},
        {"uri": "hf://meta/llama@v1", "revision": "v1"},
        {"model": {"uri": "s3://b/m", "credentials": {"name": "s3"}, "region": "eu-west-1"}},
        {"tensor": 8},  # exactly the largest node
        {"initHooks": {"library": "hooks/libinit.so"}},
        {"initHooks": {"library": "./libinit.so"}},
        {"initHooks": {"library": "lib..so"}},
        {"initHooks": {"library": "/opt/lib/libinit.so", "allowOutsideModelDir": True}},
        {"probe": {"request": PROBE_REQUEST}},
    ],
)
def test_valid_specs_pass_validation(changes: dict[str, Any]) -> None:
    spec = _spec_with(changes)
    assert validate(spec, observe()) is None
    result = run(spec, observe())
    assert result.status.phase != Phase.FAILED
    assert result.create


def test_unknown_gpu_capacity_skips_the_tensor_check() -> None:
    spec = make_spec(1, tensor=64)
    assert validate(spec, observe(max_node_gpus=None)) is None
    assert validate(spec, observe(max_node_gpus=8)) is not None


def test_the_tensor_check_names_the_templates_gpu_resource() -> None:
    spec = make_spec(1, tensor=8, template={"gpuResource": "nvidia.com/mig-1g.10gb"})
    assert validate(spec, observe(max_node_gpus=7)) == (
        "spec.parallelism.tensor: 8 GPUs per pod but the largest node offers 7 "
        "nvidia.com/mig-1g.10gb"
    )


# --------------------------------------------------------------------- status, conditions


def test_status_fields_of_a_ready_deployment() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(SPEC, 1, Role.TARGET), mkpod(SPEC, 2, Role.TARGET)]
    result = run(SPEC, observe(pods, generation=7))
    status = result.status
    assert status.phase == Phase.READY
    assert status.ready == "3/3" and status.ready_replicas == 3 and status.replicas == 3
    assert status.updated_replicas == 3
    assert status.loaded == "100%"
    assert status.selector == f"{DEPLOYMENT_LABEL}={NAME},!{SPARE_LABEL}"
    assert status.observed_generation == 7
    assert status.model_identity == ID
    assert [s.pod for s in status.sources] == [p.name for p in pods]
    assert [r.name for r in status.replica_statuses] == [p.name for p in pods]
    assert all(r.ready and r.phase == "Ready" for r in status.replica_statuses)
    assert [(c.type, c.status, c.reason) for c in status.conditions] == [
        ("Scheduled", "True", "AllScheduled"),
        ("WeightsLoaded", "True", "Loaded"),
        ("InferenceReady", "True", "ProbesPassed"),
        ("Ready", "True", "Ready"),
    ]
    assert result.requeue_after == 7.0
    assert reasons(result) == ["PhaseReady"]


def test_loaded_percentage_counts_bytes_of_every_desired_replica() -> None:
    pods = [
        mkpod(SPEC, 0, Role.SOURCE),  # 100/100
        mkpod(
            SPEC,
            1,
            Role.TARGET,
            state="loading",
            worker=WorkerReport(phase="Loading", bytes_loaded=50, bytes_total=100),
        ),
    ]
    # The third replica does not exist yet: (100 + 50 + 0) / 300.
    result = run(SPEC, observe(pods))
    assert result.status.loaded == "50%"
    assert result.status.ready == "1/3"


def test_loaded_is_zero_before_anything_loads() -> None:
    result = run(SPEC, observe())
    assert result.status.loaded == "0%"
    assert result.status.ready == "0/3"


def test_conditions_while_creating() -> None:
    result = run(SPEC, observe())
    got = {c.type: (c.status, c.reason) for c in result.status.conditions}
    assert got == {
        "Scheduled": ("False", "Pending"),
        "WeightsLoaded": ("False", "Loading"),
        "InferenceReady": ("False", "Probing"),
        "Ready": ("False", "Pending"),
    }
    assert all(c.last_transition_time == rfc3339(T0) for c in result.status.conditions)


def test_last_transition_time_is_kept_while_a_condition_holds() -> None:
    pods = [mkpod(SPEC, i, Role.SOURCE if i == 0 else Role.TARGET) for i in range(3)]
    first = run(SPEC, observe(pods))
    later = T0 + timedelta(minutes=5)
    second = run(SPEC, observe(pods, now=later, previous=first.status))
    assert [c.last_transition_time for c in second.status.conditions] == [rfc3339(T0)] * 4
    assert reasons(second) == []  # no phase change, no event
    # One replica stops passing its probe: InferenceReady and Ready flip, the others stay.
    degraded = [*pods[:2], mkpod(SPEC, 2, Role.TARGET, state="probe-failed")]
    third = run(SPEC, observe(degraded, now=later, previous=second.status))
    times = {c.type: c.last_transition_time for c in third.status.conditions}
    assert times == {
        "Scheduled": rfc3339(T0),
        "WeightsLoaded": rfc3339(T0),
        "InferenceReady": rfc3339(later),
        "Ready": rfc3339(later),
    }
    assert third.status.phase == Phase.DEGRADED
    assert ("Warning", "PhaseDegraded") in [(e.type, e.reason) for e in third.events]
    assert condition(third, "InferenceReady").reason == "ProbeFailed"
    assert "differs" in condition(third, "InferenceReady").message


def test_missing_transition_time_in_previous_status_is_filled_in() -> None:
    pods = [mkpod(SPEC, i, Role.TARGET) for i in range(3)]
    previous = ModelDeploymentStatus(
        conditions=[Condition(type="Ready", status="True", reason="Ready")]
    )
    result = run(SPEC, observe(pods, previous=previous))
    assert condition(result, "Ready").last_transition_time == rfc3339(T0)


def test_a_pod_whose_image_cannot_be_pulled_is_named_in_status() -> None:
    stuck = "image ghcr.io/weightlift/worker:nope: ImagePullBackOff (not found)"
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="pending", stuck=stuck, node="gpu-0")]
    result = run(SPEC, observe(pods))
    assert result.status.phase == Phase.PENDING
    assert result.status.message == f"{pods[0].name}: {stuck}"
    assert result.status.replica_statuses[0].message == stuck


def test_unschedulable_pods_surface_the_scheduler_message() -> None:
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="pending", unschedulable=message)]
    result = run(SPEC, observe(pods))
    assert result.status.phase == Phase.PENDING
    assert message in result.status.message and pods[0].name in result.status.message
    scheduled = condition(result, "Scheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    assert message in scheduled.message
    entry = result.status.replica_statuses[0]
    assert entry.phase == "Pending" and entry.message == message
    # The scheduler's next word comes as a pod event, which wakes the loop: no fast poll.
    assert result.requeue_after == min(POLL_PENDING, 7.0)  # SPEC's probe period is 7 s


def test_only_what_pod_events_do_not_show_is_polled_fast() -> None:
    spec = make_spec(3)
    # The source is pending and the others wait for it: pod events say when it moves.
    pending = run(spec, observe([mkpod(spec, 0, Role.SOURCE, state="scheduled")]))
    assert pending.status.waiting_since is not None and standby(pending) == [1, 2]
    assert pending.requeue_after == min(POLL_PENDING, 7.0)
    # A running worker's loading progress and its probe show only when asked.
    for state in ("loading", "loaded", "probe-failed"):
        moving = run(spec, observe([mkpod(spec, 0, Role.SOURCE, state=state)]))
        assert moving.requeue_after == POLL_WHILE_LOADING, state


def test_probing_phase_when_only_the_probe_is_missing() -> None:
    spec = make_spec(1)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE, state="loaded")]))
    assert result.status.phase == Phase.PROBING
    assert condition(result, "WeightsLoaded").status == "True"
    assert condition(result, "InferenceReady").status == "False"


def test_probe_failure_without_any_ready_replica_is_probing_not_degraded() -> None:
    spec = make_spec(1)
    result = run(spec, observe([mkpod(spec, 0, Role.SOURCE, state="probe-failed")]))
    assert result.status.phase == Phase.PROBING
    assert "differs" in result.status.message


def test_replica_status_phase_follows_the_worker_report() -> None:
    pods = [
        mkpod(SPEC, 0, Role.SOURCE),
        mkpod(SPEC, 1, Role.TARGET, state="loading"),
        mkpod(SPEC, 2, Role.TARGET, state="scheduled"),
    ]
    result = run(SPEC, observe(pods))
    phases = [r.phase for r in result.status.replica_statuses]
    assert phases == ["Ready", "Loading", "Scheduled"]
    assert result.status.phase == Phase.LOADING


def test_replica_statuses_list_current_identity_first() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE), mkpod(NEW, 0, Role.SOURCE, state="loading")]
    result = run(NEW, observe(pods))
    assert [r.model_identity for r in result.status.replica_statuses] == [NEW_ID, ID]


def test_zero_replicas_is_ready_and_every_condition_true() -> None:
    result = run(make_spec(0), observe())
    assert result.status.phase == Phase.READY
    assert result.status.ready == "0/0"
    assert all(c.status == "True" for c in result.status.conditions)
    assert result.create == [] and result.delete == {}


def test_phase_events_only_for_outcomes_and_only_on_change() -> None:
    first = run(SPEC, observe())
    assert first.status.phase == Phase.PENDING
    assert reasons(first) == []  # progress: the status and its conditions say it
    ready = run(make_spec(0), observe())
    assert reasons(ready) == ["PhaseReady"]
    again = run(make_spec(0), observe(previous=ready.status))
    assert again.status.phase == Phase.READY and reasons(again) == []


def test_pod_name_is_deployment_identity_prefix_and_index() -> None:
    assert pod_name("llm", "abcdef0123456789", 3) == "llm-abcdef-3"
    assert len({pod_name("llm", ID, i) for i in range(50)}) == 50


def test_plan_does_not_mutate_its_inputs() -> None:
    pods = [mkpod(SPEC, 0, Role.SOURCE, state="failed"), mkpod(SPEC, 1, Role.TARGET)]
    observed = observe(pods)
    before = (list(observed.pods), observed.previous)
    run(SPEC, observed)
    assert (observed.pods, observed.previous) == before


def test_local_paths_need_an_allowed_prefix() -> None:
    """The default (no prefixes configured) refuses every hostpath:// and file:// URI."""
    spec = make_spec(uri="hostpath:///models/llama")
    assert validate(spec, observe()) is None
    problem = validate(spec, observe(model_path_prefixes=()))
    assert problem is not None and problem.startswith("spec.model.uri: /models/llama is not below")
    assert validate(make_spec(uri="pvc://models/llama"), observe(model_path_prefixes=())) is None
    assert validate(spec, observe(model_path_prefixes=("/data", "/models/llama"))) is None
