"""Multi-pod replicas (spec.parallelism.podsPerReplica > 1) as LeaderWorkerSet groups.

One LeaderWorkerSet per revision (model identity) runs every group of it from one template, so a
group's role cannot be in its pods' env: its pods start waiting (a Target with no peers) and the
hand-off annotation tells each pod its role, its rank-matched peers and its group's leader.
Planning (planning.py) sees a group as one replica: `collapse` sums a group's pods up into its
leader's ObservedPod (members kept), and what planning decides for a leader is spread here over
the group's pods (`spread_handoffs`) and over the LeaderWorkerSets (`lws_replicas`).

LWS names group g's leader pod `<set>-g` and its other pods `<set>-g-<index>`; with the set
named `<deployment>-<identity6>`, a leader's name is planning.pod_name(deployment, identity, g).
The leader's address travels in the hand-off rather than LWS_LEADER_ADDRESS (a DNS name), so
groups need no cluster DNS: the operator knows the leader's pod IP when it hands a role.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    DEPLOYMENT_UID_LABEL,
    IDENTITY_LABEL,
    LWS_API_VERSION,
    LWS_GROUP,
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
from weightlift.operator.planning import DesiredPod, ObservedPod, Plan, host_port
from weightlift.operator.pods import render_pod
from weightlift.operator.settings import Settings
from weightlift.operator.shared_objects import PlanConfigMap

LWS_KIND = "LeaderWorkerSet"
# Planning's reasons for deleting a replica that LeaderWorkerSets carry out by their replica
# count (they remove the highest groups) rather than by deleting a leader pod.
SHRINK_REASONS = ("scaled down", "superseded by a new model identity", "rolled over")


def lws_name(deployment: str, identity: str) -> str:
    return f"{deployment}-{identity[:6]}"


def render_lws(
    name: str,
    namespace: str,
    uid: str,
    spec: ModelDeploymentSpec,
    identity: str,
    replicas: int,
    plan: PlanConfigMap,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """The revision's LeaderWorkerSet: the worker pod of render_pod (waiting for its hand-off)
    as the template of every pod of every group."""
    set_name = lws_name(name, identity)
    waiting = DesiredPod(set_name, 0, Role.TARGET, identity, [])
    pod = render_pod(name, namespace, uid, spec, waiting, plan, settings)
    meta, pod_spec = pod["metadata"], pod["spec"]
    labels = {k: v for k, v in meta["labels"].items() if k != REPLICA_LABEL}
    # The pods' owner is LWS's StatefulSet: the operator's pod index finds them by this label.
    labels[DEPLOYMENT_UID_LABEL] = uid
    # StatefulSets take only restartPolicy Always: a rank that fails restarts in place. LWS's
    # restartPolicy None leaves the group to the operator, which sees the restart (or the
    # worker's Failed report), recreates the group by deleting its leader and counts it, up to
    # spec.parallelism.maxGroupRestarts: LWS's RecreateGroupOnPodRestart would recreate a
    # broken group forever, uncounted. A permanent failure does not exit (the worker reports
    # it and waits), so it shows in status instead of a crash loop.
    pod_spec["restartPolicy"] = "Always"
    container = pod_spec["containers"][0]
    container["ports"].append(
        {"name": GROUP_PORT_NAME, "containerPort": GROUP_PORT, "protocol": "TCP"}
    )
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_API_VERSION}",
        "kind": LWS_KIND,
        "metadata": {
            "name": set_name,
            "namespace": namespace,
            "labels": {**MANAGED_BY, DEPLOYMENT_LABEL: name, IDENTITY_LABEL: identity},
            "ownerReferences": meta["ownerReferences"],
        },
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.parallelism.pods_per_replica,
                "restartPolicy": "None",
                "workerTemplate": {
                    "metadata": {"labels": labels, "annotations": meta["annotations"]},
                    "spec": pod_spec,
                },
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
    """Single-pod replicas as they are; each group as its leader, summing up its pods: Ready
    only with all `size` pods Ready, failed when one failed, terminating when one is. A group
    whose leader is gone is left out: LWS (or garbage collection) is taking its pods."""
    out: list[ObservedPod] = []
    groups: dict[tuple[str, int], dict[int, ObservedPod]] = {}
    for raw, pod in pods:
        index = group_index(raw)
        if index is None:
            out.append(pod)
        else:
            groups.setdefault((pod.identity, pod.replica), {})[index] = pod
    for by_index in groups.values():
        leader = by_index.get(0)
        if leader is None:
            continue
        members = tuple(by_index[i] for i in sorted(by_index))
        broken = next((m for m in members if m.failed and m is not leader), None)
        # A pod that restarted in place left its group broken (restartPolicy None: the
        # operator, not LWS, recreates the group, counting it).
        restarted = any(m.container_restarts for m in members)
        out.append(
            replace(
                leader,
                pod_ready=len(members) >= size and all(m.pod_ready for m in members),
                terminating=any(m.terminating for m in members),
                failure=leader.failure
                or (f"{broken.name}: {broken.failure_message}" if broken else None),
                phase="Failed"
                if restarted or (broken and broken.phase == "Failed")
                else leader.phase,
                failed_at=leader.failed_at or (broken.failed_at if broken else None),
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
    handed nothing yet, its relabel held back with it: planning offers again next pass."""
    handoff: dict[str, PeerHandoff] = {}
    relabel: dict[str, Role] = {}
    for name, given in result.handoff.items():
        group = groups.get(name)
        if group is None:
            handoff[name] = given
            continue
        if not _complete(group, size):
            result.relabel.pop(name, None)
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


@dataclass(frozen=True)
class GroupActions:
    """What the LeaderWorkerSets and group pods need for a plan."""

    replicas: dict[str, int]  # LeaderWorkerSet name -> replicas (0: delete it)
    delete_pods: dict[str, str]  # leader pod -> why (its group is recreated by LWS)


def group_actions(
    deployment: str,
    spec: ModelDeploymentSpec,
    identity: str,
    groups: list[ObservedPod],
    result: Plan,
) -> GroupActions:
    """Planning creates and deletes replicas by name; LWS keeps groups 0..replicas-1. So a
    scale-down or a roll-over sets the count (the highest groups go), a failed group is
    replaced by deleting its leader (LWS recreates it), and creations raise the count."""
    current = {g.replica for g in groups if g.identity == identity}
    created = {d.replica for d in result.create}
    old_left = [
        g
        for g in groups
        if g.identity != identity and not result.delete.get(g.name, "").startswith(SHRINK_REASONS)
    ]
    want = spec.replicas if not old_left else min(spec.replicas, len(current | created))
    replicas = {lws_name(deployment, identity): want}
    for old in {g.identity for g in groups if g.identity != identity}:
        replicas[lws_name(deployment, old)] = sum(g.identity == old for g in old_left)
    delete_pods = {
        pod: why
        for pod, why in result.delete.items()
        if not why.startswith(SHRINK_REASONS)
        and any(g.name == pod and g.identity == identity for g in groups)
    }
    return GroupActions(replicas, delete_pods)
