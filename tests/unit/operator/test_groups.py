"""Multi-pod replicas (LeaderWorkerSet groups): planning sees a group as one replica; groups.py
sums its pods up, spreads hand-offs rank-matched over them, gives a group's Service label and
readiness gate to its leader only, and maps creates and deletes onto LeaderWorkerSet replica
counts."""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.support.planning import NAME, NAMESPACE, ident, make_spec, mkpod, observe
from weightlift.api.labels import (
    DEPLOYMENT_UID_LABEL,
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    REPLICA_LABEL,
)
from weightlift.api.model import (
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    RankTransport,
    Role,
)
from weightlift.api.worker import GROUP_PORT, PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator.groups import (
    collapse,
    group_actions,
    lws_name,
    render_lws,
    spread_handoffs,
)
from weightlift.operator.identity import pod_template_revision
from weightlift.operator.planning import ObservedPod, Plan, plan, pod_name
from weightlift.operator.pods import plan_for
from weightlift.operator.reconcile import pod_essentials

PORT = 8000


def group_spec(replicas: int = 2, restarts: int = 3, **extra: Any) -> ModelDeploymentSpec:
    parallelism = {"tensor": 2, "podsPerReplica": 2, "maxGroupRestarts": restarts}
    return make_spec(replicas, tensor=2, parallelism=parallelism, **extra)


def raw(index: int, set_name: str) -> dict[str, Any]:
    """A group pod's labels: LWS's (one set per group: group index 0) and the set's name, as
    the operator's pod index keeps them (pod_essentials)."""
    labels = {
        LWS_WORKER_INDEX_LABEL: str(index),
        LWS_GROUP_INDEX_LABEL: "0",
        LWS_NAME_LABEL: set_name,
        "controller-revision-hash": "dropped",
    }
    return pod_essentials({"metadata": {"name": member(set_name, index), "labels": labels}})


def member(group: str, index: int) -> str:
    """LWS's name for pod `index` of the only group of set `group`."""
    return f"{group}-0" if index == 0 else f"{group}-0-{index}"


def group_pods(
    spec: ModelDeploymentSpec, group: int, state: str, role: Role = Role.TARGET, **leader: Any
) -> list[tuple[dict[str, Any], ObservedPod]]:
    """Leader and worker of group `group`, each holding one rank (10.0.<group>.<index>)."""
    out = []
    for index in range(2):
        pod = mkpod(spec, group, role, state=state, pod_ip=f"10.0.{group}.{index + 1}")
        set_name, name = pod.name, member(pod.name, index)
        report = pod.worker
        if report is not None:
            report = report.model_copy(update={"ranks": [index], "loaded_from": "storage:pvc"})
        pod = dataclasses.replace(pod, name=name, worker=report)
        if index == 0:
            pod = dataclasses.replace(pod, **leader)
        out.append((raw(index, set_name), pod))
    return out


def test_a_group_is_its_leader_summing_up_its_pods() -> None:
    spec = group_spec()
    ready = collapse(group_pods(spec, 0, "ready"), 2)
    (group,) = ready
    assert group.name == pod_name(NAME, ident(spec), 0) and group.inference_ready
    assert [m.name for m in group.members] == [member(group.name, 0), member(group.name, 1)]
    assert group.worker is not None and group.worker.bytes_loaded == 200
    assert group.worker.ranks == [0, 1]
    # One pod still loading: the group is not Ready, whatever its leader's probe said.
    pods = group_pods(spec, 0, "ready")
    pods[1] = (pods[1][0], dataclasses.replace(pods[1][1], pod_ready=False))
    assert not collapse(pods, 2)[0].inference_ready
    # A pod missing (LWS has not made it yet): not Ready either.
    assert not collapse(group_pods(spec, 0, "ready")[:1], 2)[0].inference_ready


def test_a_failed_rank_fails_its_group_naming_the_pod() -> None:
    spec = group_spec()
    pods = group_pods(spec, 0, "ready")
    broken = WorkerReport(phase=WorkerPhase.FAILED, message="group rank 0 at 10.0.0.1 is gone")
    pods[1] = (pods[1][0], dataclasses.replace(pods[1][1], worker=broken))
    (group,) = collapse(pods, 2)
    assert group.failed and not group.inference_ready
    assert group.worker is not None and group.worker.message.startswith(f"{pods[1][1].name}: ")


def test_single_pod_replicas_pass_through() -> None:
    spec = make_spec(2)
    pods = [({"metadata": {"labels": {REPLICA_LABEL: "0"}}}, mkpod(spec, 0, Role.SOURCE))]
    assert collapse(pods, 1) == [pods[0][1]]


def test_the_first_group_loads_from_storage_the_second_waits_then_pulls_rank_matched() -> None:
    spec = group_spec()
    identity = ident(spec)
    # Planning creates both groups waiting: one LWS template serves every group.
    first = plan(spec, observe([]))
    assert [(d.replica, d.role, d.peers) for d in first.create] == [
        (0, Role.TARGET, []),
        (1, Role.TARGET, []),
    ]
    # Both groups exist, nothing handed yet: group 0 gets storage and the Source role, on every
    # pod, with the rendezvous at its leader; group 1 waits.
    pods = group_pods(spec, 0, "scheduled") + group_pods(spec, 1, "scheduled")
    groups = collapse(pods, 2)
    result = plan(spec, observe(groups))
    by_name = {g.name: g for g in groups}
    spread_handoffs(result, by_name, 2, PORT)
    g0 = pod_name(NAME, identity, 0)
    assert result.handoff == {
        member(g0, 0): PeerHandoff(storage=True, leader=f"10.0.0.1:{GROUP_PORT}"),
        member(g0, 1): PeerHandoff(storage=True, leader=f"10.0.0.1:{GROUP_PORT}"),
    }
    assert result.relabel == {member(g0, 0): Role.SOURCE, member(g0, 1): Role.SOURCE}
    # Group 0 Ready: group 1's pod i pulls from group 0's pod i only.
    pods = group_pods(spec, 0, "ready", Role.SOURCE) + group_pods(spec, 1, "scheduled")
    groups = collapse(pods, 2)
    result = plan(spec, observe(groups))
    spread_handoffs(result, {g.name: g for g in groups}, 2, PORT)
    g1 = pod_name(NAME, identity, 1)
    leader1 = f"10.0.1.1:{GROUP_PORT}"
    assert result.handoff[member(g1, 0)].leader == leader1
    assert [(c.pod, c.address) for c in result.handoff[member(g1, 0)].peers] == [
        (member(g0, 0), f"10.0.0.1:{PORT}")
    ]
    assert [(c.pod, c.address) for c in result.handoff[member(g1, 1)].peers] == [
        (member(g0, 1), f"10.0.0.2:{PORT}")
    ]
    assert result.status.ready_replicas == 1
    (entry,) = [r for r in result.status.replica_statuses if r.name == g0]
    assert entry.pods is not None
    assert [(p.name, p.ranks, p.loaded_from) for p in entry.pods] == [
        (member(g0, 0), [0], "storage:pvc"),
        (member(g0, 1), [1], "storage:pvc"),
    ]


def test_an_incomplete_group_is_handed_nothing_yet() -> None:
    spec = group_spec(1)
    pods = group_pods(spec, 0, "scheduled")
    pods[1] = (pods[1][0], dataclasses.replace(pods[1][1], pod_ip=None))
    groups = collapse(pods, 2)
    result = plan(spec, observe(groups))
    assert result.handoff and result.relabel  # planning hands the group storage...
    spread_handoffs(result, {g.name: g for g in groups}, 2, PORT)
    assert result.handoff == {} and result.relabel == {}  # ...once all its pods have IPs
    assert result.requeue_after <= 1.0  # and looks again soon


def test_each_group_is_a_set_made_and_deleted_as_planning_chooses() -> None:
    spec = group_spec(2)
    identity = ident(spec)
    result = plan(spec, observe([]))
    actions = group_actions({}, result)
    assert [(d.name, d.replica) for d in actions.create] == [
        (lws_name(NAME, identity, 0), 0),
        (lws_name(NAME, identity, 1), 1),
    ]
    groups = collapse(group_pods(spec, 0, "failed") + group_pods(spec, 1, "ready"), 2)
    by_name = {g.name: g for g in groups}
    # A failed group: its leader pod is deleted (LWS recreates the group), its set stays.
    result = Plan(delete={groups[0].name: "replacing failed replica: OOMKilled"})
    actions = group_actions(by_name, result)
    assert actions.delete_pods == {member(groups[0].name, 0): "replacing failed replica: OOMKilled"}
    assert actions.delete_sets == {} and actions.create == []


def test_scale_down_deletes_the_group_planning_chooses_not_the_highest() -> None:
    """3 groups, the middle one still loading: scaled to 2, planning picks the not-Ready one
    (LWS's own replica count would have dropped the highest, a Ready group)."""
    spec = group_spec(2)
    pods = (
        group_pods(spec, 0, "ready", Role.SOURCE)
        + group_pods(spec, 1, "loading")
        + group_pods(spec, 2, "ready")
    )
    groups = {g.name: g for g in collapse(pods, 2)}
    result = plan(spec, observe(list(groups.values())))
    middle = lws_name(NAME, ident(spec), 1)
    assert result.delete == {middle: "scaled down"}
    actions = group_actions(groups, result)
    assert actions.delete_sets == {middle: "scaled down"}
    assert actions.delete_pods == {} and actions.create == []


def test_the_lws_template_waits_for_its_role_and_carries_the_owner_uid() -> None:
    spec = group_spec(2)
    identity = ident(spec)
    desired = plan(spec, observe([])).create[1]
    lws = render_lws(
        NAME, NAMESPACE, "uid-1", spec, desired, plan_for(NAME, NAMESPACE, spec, identity)
    )
    # One set per group, named as planning names the replica; LWS's leader is `<set>-0`.
    assert lws["metadata"]["name"] == lws_name(NAME, identity, 1) == pod_name(NAME, identity, 1)
    assert lws["spec"]["replicas"] == 1
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "None"
    pod = template["workerTemplate"]
    assert pod["metadata"]["labels"][DEPLOYMENT_UID_LABEL] == "uid-1"
    assert pod["metadata"]["labels"][REPLICA_LABEL] == "1"
    assert pod["spec"]["restartPolicy"] == "Always"
    (container,) = pod["spec"]["containers"]
    # One GPU per rank of the pod, not the replica's tensor size.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["group"] == GROUP_PORT
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert '"role":"Target"' in env["WEIGHTLIFT_ASSIGNMENT"]
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_each_ranks_transport_reaches_the_replica_status() -> None:
    """A group's ranks live in several pods' reports; the replica lists every rank's transport
    (the one path: planning._transports), as a single pod's replica lists its own."""
    spec = group_spec(1)
    pods = group_pods(spec, 0, "ready", Role.SOURCE)
    for i, (labels, pod) in enumerate(pods):
        assert pod.worker is not None
        said = RankTransport(rank=i, transport="cuda_ipc/cuda (zero-copy)")
        pods[i] = (
            labels,
            dataclasses.replace(pod, worker=pod.worker.model_copy(update={"transports": [said]})),
        )
    result = plan(spec, observe(collapse(pods, 2)))
    (entry,) = result.status.replica_statuses
    assert entry.transports is not None
    assert [(t.rank, t.transport) for t in entry.transports] == [
        (0, "cuda_ipc/cuda (zero-copy)"),
        (1, "cuda_ipc/cuda (zero-copy)"),
    ]
    single = make_spec(1)
    pod = mkpod(single, 0, Role.TARGET, state="ready")
    assert pod.worker is not None
    note = "UCX moves GPU memory (VRAM to VRAM) only by tcp/lo (software emulation): ..."
    said = RankTransport(rank=0, transport="tcp/lo (software emulation)", note=note)
    pod = dataclasses.replace(pod, worker=pod.worker.model_copy(update={"transports": [said]}))
    (entry,) = plan(single, observe([pod])).status.replica_statuses
    assert entry.transports == [said]
    wire = entry.model_dump(by_alias=True, exclude_none=True)
    assert wire["transports"] == [{"rank": 0, "transport": said.transport, "note": note}]


# ---------------------------------------------------------------- groups that fail in a row


def failed_group(spec: ModelDeploymentSpec, group: int = 0) -> ObservedPod:
    """Group `group` whose rank 1 restarted in place (restartPolicy Always) after exiting."""
    pods = group_pods(spec, group, "ready", Role.SOURCE)
    worker = dataclasses.replace(
        pods[1][1],
        container_restarts=1,
        failure="worker exited with code 1: group rank 0 at 10.0.0.1 is gone",
    )
    pods[1] = (pods[1][0], worker)
    (collapsed,) = collapse(pods, 2)
    return collapsed


def after(restarts: dict[str, int], generation: int = 3) -> ModelDeploymentStatus:
    return ModelDeploymentStatus(observed_generation=generation, group_restarts=restarts)


def test_a_pod_restarted_in_place_fails_its_group_naming_it() -> None:
    group = failed_group(group_spec(1))
    assert group.failed and not group.inference_ready and group.phase == "Failed"
    assert group.failure_message == (
        f"{member(group.name, 1)}: worker exited with code 1: group rank 0 at 10.0.0.1 is gone"
    )


def test_a_failed_group_is_recreated_and_counted_up_to_max_group_restarts() -> None:
    spec = group_spec(1, restarts=2)
    group = failed_group(spec)
    # The first failure: recreated (its leader deleted), counted in the status.
    first = plan(spec, observe([group]))
    assert first.delete[group.name].startswith("replacing failed replica")
    assert first.status.group_restarts == {group.name: 1}
    # The count survives in the status (an operator restart reads it back): the second too.
    second = plan(spec, observe([group], previous=after({group.name: 1})))
    assert group.name in second.delete and second.status.group_restarts == {group.name: 2}
    # The third failure in a row: left Failed, naming the pod and why, nothing recreated.
    third = plan(spec, observe([group], previous=after({group.name: 2})))
    assert not third.delete and not third.create
    assert third.status.phase == Phase.FAILED
    assert third.status.message == (
        f"{group.name} failed 3 times in a row (spec.parallelism.maxGroupRestarts 2), not "
        f"recreated until the spec changes: {member(group.name, 1)}: worker exited with code 1: "
        "group rank 0 at 10.0.0.1 is gone"
    )
    assert third.status.group_restarts == {group.name: 2}


def test_a_given_up_group_stays_failed_while_none_of_its_pods_shows_failed() -> None:
    """Seen in e2e: between rank 1's exit and the kubelet noticing it, its report cannot be read
    and no pod shows failed; the phase stays Failed with why, never back to Loading."""
    spec = group_spec(1, restarts=1)
    group = failed_group(spec)
    given_up = plan(spec, observe([group], previous=after({group.name: 1})))
    assert given_up.status.phase == Phase.FAILED
    loading = collapse(group_pods(spec, 0, "loading", Role.SOURCE), 2)
    assert not loading[0].failed
    previous = given_up.status.model_copy(update={"observed_generation": 3})
    result = plan(spec, observe(loading, previous=previous))
    assert result.status.phase == Phase.FAILED and not result.delete and not result.create
    assert result.status.message == given_up.status.message
    assert result.status.group_restarts == {group.name: 1}
    # Not before it was given up: a group loading with a count below the limit is Loading.
    result = plan(spec, observe(loading, previous=after({group.name: 1})))
    assert result.status.phase != Phase.FAILED


def test_a_spec_change_or_a_ready_group_starts_the_count_over() -> None:
    spec = group_spec(1, restarts=2)
    group = failed_group(spec)
    changed = plan(spec, observe([group], previous=after({group.name: 2}, generation=2)))
    assert group.name in changed.delete and changed.status.group_restarts == {group.name: 1}
    ready = collapse(group_pods(spec, 0, "ready", Role.SOURCE), 2)
    result = plan(spec, observe(ready, previous=after({group.name: 2})))
    assert result.status.group_restarts is None
    # A group being recreated (its pods not observed yet) keeps its count.
    result = plan(spec, observe([], previous=after({group.name: 2})))
    assert result.status.group_restarts == {group.name: 2}


def test_max_group_restarts_zero_never_recreates() -> None:
    spec = group_spec(1, restarts=0)
    result = plan(spec, observe([failed_group(spec)]))
    assert not result.delete and result.status.phase == Phase.FAILED


def test_a_previous_leaders_pod_does_not_fail_the_recreated_group() -> None:
    """Right after a group is recreated, the old leader's rank 1 (restarted, not yet garbage-
    collected) is older than the new leader: it is not the new group's, which waits for its own
    rank 1 instead of failing (and being counted) again."""
    spec = group_spec(1)
    pods = group_pods(spec, 0, "loading")
    stale = dataclasses.replace(pods[1][1], container_restarts=1, failure="worker exited")
    leader_raw = {
        "metadata": {**pods[0][0]["metadata"], "creationTimestamp": "2026-01-01T00:00:09Z"}
    }
    stale_raw = {
        "metadata": {**pods[1][0]["metadata"], "creationTimestamp": "2026-01-01T00:00:08Z"}
    }
    (group,) = collapse([(leader_raw, pods[0][1]), (stale_raw, stale)], 2)
    assert [m.name for m in group.members] == [member(group.name, 0)]
    assert not group.failed and not group.pod_ready
    # Made in the same second as its leader or later: the group's own.
    stale_raw["metadata"]["creationTimestamp"] = "2026-01-01T00:00:09Z"
    (group,) = collapse([(leader_raw, pods[0][1]), (stale_raw, stale)], 2)
    assert len(group.members) == 2 and group.failed


def test_a_restarted_pods_last_run_names_the_failure_not_its_new_run() -> None:
    spec = group_spec(1)
    (_, pod) = group_pods(spec, 0, "loading")[1]
    assert pod.worker is not None
    running_again = pod.worker.model_copy(update={"message": "loading 1/2 files"})
    pod = dataclasses.replace(
        pod, worker=running_again, container_restarts=1, failure="worker exited with code 1: x"
    )
    assert pod.failed and pod.failure_message == "worker exited with code 1: x"


def test_a_group_being_recreated_is_not_replaced_by_another() -> None:
    """Its leader deleted, a failed group is out of planning's sight, which asks for another
    replica; its set still exists (its pods say so), so none is made beside it."""
    spec = group_spec(1)
    identity = ident(spec)
    result = plan(spec, observe([]))
    g0, g1 = lws_name(NAME, identity, 0), lws_name(NAME, identity, 1)
    prefix = g0[:-1]
    made = group_actions({}, result, {g0}, spec.replicas, prefix)
    assert made.create == []
    # Another identity's sets (a roll-over) do not count; a set not there yet is made.
    result.create = [dataclasses.replace(result.create[0], name=g1, replica=1)]
    made = group_actions({}, result, {"llm-ffffff-0"}, spec.replicas, prefix)
    assert [d.name for d in made.create] == [g1]


def test_a_template_rollout_makes_a_surge_group_beside_the_old_template_ones() -> None:
    """Sets of an older pod template (same identity, same name prefix) leave the cap's count:
    planning's surge set is made, or the old sets would never be rolled over."""
    old_spec = group_spec(1)
    spec = group_spec(1, template={"env": [{"name": "ROLL", "value": "2"}]})
    identity = ident(spec)
    g0 = lws_name(NAME, identity, 0)
    old = dataclasses.replace(mkpod(old_spec, 0, Role.SOURCE, name=g0), template="0ld0ld0ld0")
    result = plan(spec, observe([old]))
    assert [d.replica for d in result.create] == [1]
    prefix = g0[:-1]
    made = group_actions(
        {g0: old}, result, {g0}, spec.replicas, prefix, pod_template_revision(spec)
    )
    assert [d.name for d in made.create] == [lws_name(NAME, identity, 1)]
    # Its own template's set counts, as before.
    mine = dataclasses.replace(old, template=pod_template_revision(spec))
    made = group_actions(
        {g0: mine}, result, {g0}, spec.replicas, prefix, pod_template_revision(spec)
    )
    assert made.create == []


def test_a_pod_between_its_exit_and_its_restart_still_fails_its_group() -> None:
    spec = group_spec(1)
    pods = group_pods(spec, 0, "loading")
    exited = dataclasses.replace(pods[1][1], worker=None, failure="worker exited with code 1: x")
    (group,) = collapse([pods[0], (pods[1][0], exited)], 2)
    assert group.failed and group.failure_message.endswith("worker exited with code 1: x")


# ------------------------------------------------------------- the Service: leaders only


def _planned(pods: list[tuple[dict[str, Any], ObservedPod]], spec: ModelDeploymentSpec) -> Plan:
    groups = collapse(pods, 2)
    result = plan(spec, observe(groups))
    spread_handoffs(result, {g.name: g for g in groups}, 2, PORT)
    return result


def test_a_group_joins_the_service_through_its_leader_with_its_hand_off() -> None:
    spec = group_spec(1)
    g0 = pod_name(NAME, ident(spec), 0)
    # Waiting, complete: handed storage, and its leader labelled in the same patch.
    result = _planned(group_pods(spec, 0, "scheduled", probe_gate=False), spec)
    assert set(result.handoff) == {member(g0, 0), member(g0, 1)}
    assert result.serve == {member(g0, 0)}
    # Incomplete (a pod without an IP): neither hand-off nor label yet.
    pods = group_pods(spec, 0, "scheduled", probe_gate=False)
    pods[1] = (pods[1][0], dataclasses.replace(pods[1][1], pod_ip=None))
    held = _planned(pods, spec)
    assert held.handoff == {} and held.serve == set()
    # Labelled already: nothing to write.
    labelled = group_pods(
        spec, 0, "ready", Role.SOURCE, handoff=PeerHandoff(storage=True), serving_labelled=True
    )
    assert _planned(labelled, spec).serve == set()


def test_a_groups_gate_is_its_leaders_and_follows_the_whole_group() -> None:
    spec = group_spec(1)
    g0 = pod_name(NAME, ident(spec), 0)
    handed = {"handoff": PeerHandoff(storage=True), "serving_labelled": True}
    ready = group_pods(spec, 0, "ready", Role.SOURCE, probe_gate=False, **handed)
    assert _planned(ready, spec).gates == {member(g0, 0): True}
    # A follower not ready: the group is not, whatever the leader's probe said: False again.
    shown = group_pods(spec, 0, "ready", Role.SOURCE, probe_gate=True, **handed)
    shown[1] = (shown[1][0], dataclasses.replace(shown[1][1], pod_ready=False))
    assert _planned(shown, spec).gates == {member(g0, 0): False}
    # A leader made before groups had the gate (probe_gate None) gets no gate writes.
    old = group_pods(spec, 0, "ready", Role.SOURCE, probe_gate=None, **handed)
    assert _planned(old, spec).gates == {}
