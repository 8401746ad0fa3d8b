"""Multi-pod replicas (spec.parallelism.podsPerReplica > 1) as LeaderWorkerSet groups.

One LeaderWorkerSet per group (replicas: 1), named as planning names the replica
(planning.pod_name: `<deployment>-<identity6>-<replica>`), so the operator creates and deletes
exactly the groups planning chooses: a scale-down removes planning's victims (not-Ready and
Targets first), where one set per revision could only drop its highest groups. LWS names the
set's leader pod `<set>-0` and its other pods `<set>-0-<index>`.
A group's role is not in its pods' env (the template is made before planning hands roles): its
pods start waiting (a Target with no peers) and the hand-off annotation tells each pod its role,
its rank-matched peers and its group's leader.
Planning (planning.py) sees a group as one replica: `collapse` sums a group's pods up into an
ObservedPod named as the set (members kept), and what planning decides for a group is spread
here over the group's pods (`spread_handoffs`) and the sets (`group_actions`).

LWS's restartPolicy is None: a pod that fails restarts in place (StatefulSets know only
restartPolicy Always) and the operator, seeing it, recreates the group by deleting its leader
and counts it (spec.parallelism.maxGroupRestarts, planning.py), where LWS's
RecreateGroupOnPodRestart would recreate a broken group forever, uncounted.
The leader's address travels in the hand-off rather than LWS_LEADER_ADDRESS (a DNS name), so
groups need no cluster DNS: the operator knows the leader's pod IP when it hands a role.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    DEPLOYMENT_UID_LABEL,
    IDENTITY_LABEL,
    LWS_API_VERSION,
    LWS_GROUP,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    MANAGED_BY,
    REPLICA_LABEL,
)
from weightlift.api.model import ModelDeploymentSpec, Role
from weightlift.api.worker import (
    GROUP_PORT,
    GROUP_PORT_NAME,
    PeerCandidate,
    PeerHandoff,
    WorkerPhase,
)
from weightlift.operator.planning import (
    ROLLED_OVER,
    SUPERSEDED,
    DesiredPod,
    ObservedPod,
    Plan,
    host_port,
    pod_name,
)
from weightlift.operator.pods import render_pod
from weightlift.operator.settings import Settings
from weightlift.operator.shared_objects import PlanConfigMap

LWS_KIND = "LeaderWorkerSet"
# Planning's reasons for deleting a replica that delete its group's LeaderWorkerSet, rather
# than its leader pod (a failed group: LWS recreates it).
SHRINK_REASONS = ("scaled down", SUPERSEDED, ROLLED_OVER)


def lws_name(deployment: str, identity: str, replica: int) -> str:
    """A group's LeaderWorkerSet: named as planning names the replica."""
    return pod_name(deployment, identity, replica)


def render_lws(
    name: str,
    namespace: str,
    uid: str,
    spec: ModelDeploymentSpec,
    desired: DesiredPod,
    plan: PlanConfigMap,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """One group's LeaderWorkerSet: the worker pod of render_pod (waiting for its hand-off)
    as the template of each of its pods."""
    set_name = lws_name(name, desired.identity, desired.replica)
    waiting = DesiredPod(set_name, desired.replica, Role.TARGET, desired.identity, [])
    pod = render_pod(name, namespace, uid, spec, waiting, plan, settings)
    meta, pod_spec = pod["metadata"], pod["spec"]
    labels = dict(meta["labels"])  # the replica label included: one set, one replica
    # The pods' owner is LWS's StatefulSet: the operator's pod index finds them by this label.
    labels[DEPLOYMENT_UID_LABEL] = uid
    # StatefulSets take only restartPolicy Always: a rank that fails restarts in place, and
    # the operator recreates its group (restartPolicy None below: see the module's doc). A
    # permanent failure does not exit (the worker reports it and waits), so it shows in
    # status instead of a crash loop.
    pod_spec["restartPolicy"] = "Always"
    container = pod_spec["containers"][0]
    container["ports"].append(
        {"name": GROUP_PORT_NAME, "containerPort": GROUP_PORT, "protocol": "TCP"}
    )
    # A group is probed through its leader, the only pod that answers the API (the others 421):
    # the leader waits for the inference-probe gate and may join the Service, the others never.
    leader_spec = copy.deepcopy(pod_spec)
    pod_spec.pop("readinessGates")
    template_meta = {"labels": labels, "annotations": meta["annotations"]}
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_API_VERSION}",
        "kind": LWS_KIND,
        "metadata": {
            "name": set_name,
            "namespace": namespace,
            "labels": {
                **MANAGED_BY,
                DEPLOYMENT_LABEL: name,
                IDENTITY_LABEL: desired.identity,
                REPLICA_LABEL: str(desired.replica),
            },
            "ownerReferences": meta["ownerReferences"],
        },
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.parallelism.pods_per_replica,
                "restartPolicy": "None",
                "leaderTemplate": {"metadata": copy.deepcopy(template_meta), "spec": leader_spec},
                "workerTemplate": {"metadata": template_meta, "spec": pod_spec},
            },
        },
    }


def group_index(raw: Mapping[str, Any]) -> int | None:
    """The pod's index in its group (0: the leader); None for a single-pod replica."""
    value = ((raw.get("metadata") or {}).get("labels") or {}).get(LWS_WORKER_INDEX_LABEL)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _summed_report(members: tuple[ObservedPod, ...]) -> Any:
    """The leader's report with the group's bytes and ranks; a failed pod's message if any."""
    leader = members[0].worker
    if leader is None:
        return None
    reports = [m.worker for m in members if m.worker is not None]
    summed = leader.model_copy(
        update={
            "bytes_loaded": sum(r.bytes_loaded for r in reports),
            "bytes_total": sum(r.bytes_total for r in reports),
            "ranks": sorted({rank for r in reports for rank in r.ranks}),
        }
    )
    for member in members:
        report = member.worker
        if report is not None and report.phase == WorkerPhase.FAILED:
            return summed.model_copy(
                update={
                    "phase": WorkerPhase.FAILED,
                    "message": f"{member.name}: {report.message}",
                    "permanent_failure": report.permanent_failure,
                }
            )
    for member in members:
        if member.container_restarts:  # restarted in place: its last run failed
            return summed.model_copy(
                update={
                    "phase": WorkerPhase.FAILED,
                    "message": f"{member.name}: {member.failure_message}",
                    "permanent_failure": False,
                }
            )
    return summed


def collapse(pods: Iterable[tuple[Mapping[str, Any], ObservedPod]], size: int) -> list[ObservedPod]:
    """Single-pod replicas as they are; each group as one replica named as its LeaderWorkerSet,
    summing up its pods: Ready only with all `size` pods Ready, failed when one failed (or
    restarted in place), terminating when one is. A group whose leader is gone is left out:
    LWS (or garbage collection) is taking its pods."""
    out: list[ObservedPod] = []
    groups: dict[str, dict[int, tuple[str, ObservedPod]]] = {}
    for raw, pod in pods:
        index = group_index(raw)
        if index is None:
            out.append(pod)
        else:
            meta = raw.get("metadata") or {}
            set_name = (meta.get("labels") or {}).get(LWS_NAME_LABEL) or pod.name
            created = str(meta.get("creationTimestamp") or "")
            groups.setdefault(set_name, {})[index] = (created, pod)
    for set_name, by_index in groups.items():
        if 0 not in by_index:
            continue
        since, leader = by_index[0]
        # A pod made before its leader is a previous leader's, not yet garbage-collected
        # (LWS makes a group's other pods after its leader): it would fail the new group.
        # RFC 3339 UTC times in one format: their strings order as the times do.
        members = tuple(
            pod for i in sorted(by_index) for created, pod in [by_index[i]] if created >= since
        )
        broken = next((m for m in members if m.failed), None)
        # A pod that restarted in place left its group broken (restartPolicy None: the
        # operator, not LWS, recreates the group, counting it).
        restarted = any(m.container_restarts for m in members)
        out.append(
            replace(
                leader,
                name=set_name,
                pod_ready=len(members) >= size and all(m.pod_ready for m in members),
                terminating=any(m.terminating for m in members),
                failure=f"{broken.name}: {broken.failure_message}" if broken else None,
                phase="Failed"
                if restarted or (broken and broken.phase == "Failed")
                else leader.phase,
                failed_at=broken.failed_at if broken else None,
                worker=_summed_report(members),
                members=members,
            )
        )
    return out


def _complete(group: ObservedPod, size: int) -> bool:
    return len(group.members) >= size and all(m.pod_ip for m in group.members)


# A group held back because a pod is missing or has no IP yet is looked at again this soon: its
# last pod's events may reach kopf's index after the pass they woke.
INCOMPLETE_RECHECK_SECONDS = 1.0


def spread_handoffs(result: Plan, groups: Mapping[str, ObservedPod], size: int, port: int) -> None:
    """Turn planning's hand-offs and relabels of group leaders into those of every pod of the
    group: pod i is handed pod i of each source group (rank-matched: they hold the same ranks)
    and its group's rendezvous. A group not yet complete (a pod missing or without an IP) is
    handed nothing yet, its relabel and Service label held back with it: planning offers again
    next pass. A group's Service label and gate go to its leader pod (planning._serving)."""
    handoff: dict[str, PeerHandoff] = {}
    relabel: dict[str, Role] = {}
    for name, given in result.handoff.items():
        group = groups.get(name)
        if group is None:
            handoff[name] = given
            continue
        if not _complete(group, size):
            result.relabel.pop(name, None)
            result.serve.discard(name)
            result.requeue_after = min(result.requeue_after, INCOMPLETE_RECHECK_SECONDS)
            continue
        leader_ip = group.members[0].pod_ip
        assert leader_ip is not None  # _complete
        rendezvous = host_port(leader_ip, GROUP_PORT)
        for i, member in enumerate(group.members):
            peers = [
                PeerCandidate(pod=pod.name, address=host_port(pod.pod_ip, port))
                for candidate in given.peers
                if (source := groups.get(candidate.pod)) is not None
                and i < len(source.members)
                and (pod := source.members[i]).pod_ip
            ]
            handoff[member.name] = PeerHandoff(
                peers=peers, storage=given.storage, leader=rendezvous
            )
    for name, role in result.relabel.items():
        group = groups.get(name)
        for member in group.members if group is not None else ():
            relabel[member.name] = role
        if group is None:
            relabel[name] = role
    result.handoff, result.relabel = handoff, relabel
    result.serve = {_leader(groups, name) for name in result.serve}
    result.gates = {_leader(groups, name): passed for name, passed in result.gates.items()}
    # The leader's labels are the group's (collapse); a set an older version made keeps its
    # own pod template, so a group it recreates is adopted again, as it was made then.
    result.adopt = {_leader(groups, name): rev for name, rev in result.adopt.items()}


def _leader(groups: Mapping[str, ObservedPod], name: str) -> str:
    """The pod that stands for replica `name`: a group's leader, or the single pod itself."""
    group = groups.get(name)
    return group.members[0].name if group is not None else name


@dataclass(frozen=True)
class GroupActions:
    """What the LeaderWorkerSets and group pods need for a plan."""

    create: list[DesiredPod]  # a LeaderWorkerSet each
    delete_sets: dict[str, str]  # LeaderWorkerSet -> why (planning's victims, old revisions)
    delete_pods: dict[str, str]  # leader pod -> why (its group failed: LWS recreates it)


def group_actions(
    groups: Mapping[str, ObservedPod],
    result: Plan,
    existing: Iterable[str] = (),
    replicas: int | None = None,
    prefix: str = "",
    template: str | None = None,
) -> GroupActions:
    """Planning creates and deletes replicas by name, and a group's LeaderWorkerSet has its
    replica's name: a creation makes the set, a scale-down or roll-over deletes the set planning
    chose, and a failed group is recreated by deleting its leader pod. `existing`: the sets
    known to exist (their pods seen, or just made); while a failed group is being recreated
    planning does not see it and would add another: the sets named `prefix...` (the current
    identity's) are kept at most `replicas`, those of an older pod template than `template`
    left out of the count (planning rolls them over: a surge set is made beside them)."""
    delete_sets: dict[str, str] = {}
    delete_pods: dict[str, str] = {}
    for name, why in result.delete.items():
        group = groups.get(name)
        if group is None:
            continue
        if why.startswith(SHRINK_REASONS):
            delete_sets[name] = why
        else:
            delete_pods[group.members[0].name] = why
    create = list(result.create)
    if replicas is not None:
        older = {s for s, g in groups.items() if template and g.template not in (None, template)}
        current = {s for s in existing if s.startswith(prefix)} - set(delete_sets) - older
        room = max(0, replicas - len(current))
        create = [d for d in create if d.name not in current][:room]
    return GroupActions(create, delete_sets, delete_pods)
