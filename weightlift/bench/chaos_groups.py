"""Chaos scenarios for replicas that span pods: LeaderWorkerSet groups (podsPerReplica 2, tensor 2,
one rank per pod) through the real LWS controller (local/lws.py), builtin runtime.

Each fault strikes on an event, never in a window found by polling:
- a source group's pod is SIGKILLed while a target group's pod pulls its rank from it, the pull
  held open mid-transfer by the node's fault gate (worker/p2p/faultgate.py, as chaos_pull.py);
- a group's leader is SIGKILLed while its other pod waits for it in the group's rendezvous: the
  gate holds both pods before they join (GROUP_JOIN), then the leader alone, and lets the other
  go; once that one has left the gate, the leader dies;
- LWS recreates a group (its leader pod deleted, as an eviction does) while that group's pod
  holds its pull open at the gate;
- the revision changes while the target group waits in Standby: the source group is held at the
  gate before it joins (loaded, never Ready), so the target group waits, a state, not a moment.

Convergence is `bench chaos`'s (replicas Ready, observedGeneration caught up, exactly their
pods and worker processes), and every scenario's `verify` waits until the watcher
(chaos_run.WeightsWatch) has probed each Ready group through its leader, so the wrong-weights
count covers groups too. Each records the pods' and the status's history from before the deploy
(local/history.py): which pods a recreation replaced, and the group restarts the operator
counted, are read from there, not from a last look.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightlift.api.labels import IDENTITY_LABEL, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL
from weightlift.bench import chaos_pull as pull
from weightlift.bench.chaos_run import Run
from weightlift.local.history import History
from weightlift.local.kube import call
from weightlift.local.procs import pid_alive
from weightlift.local.stack import make_demo_model
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
PODS = 2  # pods per replica, one rank each
PARALLELISM: JSON = {"tensor": PODS, "podsPerReplica": PODS}
GROUP_MB = 4.0
# A deadline for a group's pods to start, load and reach the gate (a loaded 2-core machine).
HOLD_TIMEOUT = 240.0
# How long a pod may take to go once its group's leader is deleted (its grace period is 30 s).
GONE_TIMEOUT = 90.0


@dataclass(frozen=True)
class GroupScenario:
    """What chaos.py makes a Scenario of (its replicas are groups of PODS pods)."""

    name: str
    inject: Callable[[Run], None]
    replicas: int
    verify: Callable[[Run], str]
    fast: bool = False


# ----------------------------------------------------------------------------- helpers


def group_model(run: Run, alt: bool = False) -> tuple[Path, JSON]:
    """A PT2 demo model presharded for tensor 2 (one file per rank) and its probe; `alt`: the
    same shapes with other weights (another seed), which fail the first one's probe."""
    out = run.models.work / ("tp2-alt" if alt else "tp2")
    if not (out / "probe.json").exists():
        make_demo_model(out, GROUP_MB, tp=PODS, seed=23 if alt else 3)
    probe: JSON = json.loads((out / "probe.json").read_text())
    return out, probe


def deploy_groups(run: Run, replicas: int, alt: bool = False, revision: str = "1") -> None:
    """Apply `replicas` groups of PODS pods; the watcher probes with this model's probe."""
    model, probe = group_model(run, alt)
    assert run.watch is not None
    run.watch.probe = probe
    run.notes.setdefault("deployed", time.monotonic())
    run.deploy(model, replicas=replicas, probe=probe, revision=revision, parallelism=PARALLELISM)


def _record(run: Run) -> None:
    """The pods' and the status's history from now on (closed when the scenario ends)."""
    kubeconfig, namespace = run.stack.kubeconfig, run.stack.namespace
    pods = History.pods(kubeconfig, namespace, run.name)
    run.cleanups.append(pods.close)
    md = History.deployment(kubeconfig, namespace, run.name)
    run.cleanups.append(md.close)
    run.notes.update(pod_history=pods, md_history=md)


def _when(run: Run) -> str:
    return f"t+{run.fault_at - run.notes['deployed']:.1f}s"


def _pod(run: Run, name: str) -> JSON:
    pod = next((p for p in run.stack.pods(run.name) if p["metadata"]["name"] == name), None)
    assert pod is not None, f"{name}: no such pod of {run.name}"
    return pod


def _label(pod: JSON, key: str) -> str:
    return str((pod["metadata"].get("labels") or {}).get(key, ""))


def group_pods(run: Run, group: str) -> dict[str, str]:
    """name -> uid of the live (not terminating) pods of `group`, by LWS's set label."""
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in run.stack.pods(run.name)
        if _label(p, LWS_NAME_LABEL) == group and not p["metadata"].get("deletionTimestamp")
    }


def _leader(run: Run, group: str) -> str:
    pods = [
        p["metadata"]["name"]
        for p in run.stack.pods(run.name)
        if _label(p, LWS_NAME_LABEL) == group and _label(p, LWS_WORKER_INDEX_LABEL) == "0"
    ]
    assert len(pods) == 1, f"{group}: leaders {pods}"
    return pods[0]


def _kill(run: Run, pod: str) -> list[int]:
    """SIGKILL every process of `pod` on the node; their pids."""
    pids = run.stack.node.pids().get(f"{run.stack.namespace}/{pod}") or []
    assert pids, f"{pod} has no process on the node"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return list(pids)


def _uids(run: Run, pod: str) -> list[str]:
    """Every uid a pod of that name had since the scenario began, in order."""
    history: History = run.notes["pod_history"]
    seen: list[str] = []
    for v in history.versions():
        if v.name == pod and v.uid not in seen:
            seen.append(v.uid)
    return seen


def most_restarts(run: Run, group: str) -> int:
    """The most recreations of `group` any status version counted (status.groupRestarts; a Ready
    group starts over, so the last status alone does not tell)."""
    history: History = run.notes["md_history"]
    counts = [int((v.status.get("groupRestarts") or {}).get(group, 0)) for v in history.versions()]
    return max(counts, default=0)


def at_join(run: Run) -> list[str]:
    """The pods of this deployment held at the gate before joining their group."""
    return sorted(a.pod for a in faultgate.waiting_at(run.gate, run.name, faultgate.GROUP_JOIN))


def probed(run: Run, replicas: int) -> None:
    """Wait until the watcher has probed `replicas` Ready groups through their leaders (their
    answers then count in the wrong-weights column; chaos converges before the next probe)."""
    assert run.watch is not None
    watch = run.watch

    def seen() -> bool:
        ready = {r["name"] for r in run.replicas() if r.get("ready")}
        return len(ready & watch.checked) >= replicas

    run.wait(f"the watcher's probe of {replicas} Ready group(s)", seen, 60.0)


def loaded(run: Run) -> str:
    """Each group's pods' sources, pod names shortened to their group's tail."""

    def short(text: object) -> str:
        return str(text).replace(f"{run.name}-", "")

    return "; ".join(
        f"{short(r['name'])}<-" + ",".join(short(p.get("loadedFrom")) for p in r.get("pods") or [])
        for r in run.replicas()
    )


# --------------------------------------------------- a source group's pod killed mid-pull


def source_pod_killed_mid_pull(run: Run) -> None:
    """Two groups: the target group's pods pull their ranks from the source group's pods of the
    same index; one pull is held open mid-transfer and the source pod it reads from is
    SIGKILLed. That pod restarts in place, the operator recreates its group (counting it), the
    held pod loads its rank elsewhere, and both groups end Ready."""
    _record(run)
    faultgate.arm(run.gate, run.name)
    try:
        deploy_groups(run, 2)
        held = pull.held_pull(run)
        peer = _pod(run, held.peer)
        run.notes.update(victim=(held.peer, peer["metadata"]["uid"], _label(peer, LWS_NAME_LABEL)))
        run.fault_at = time.monotonic()
        _kill(run, held.peer)
    finally:
        faultgate.disarm(run.gate, run.name)


def verify_source_pod_killed(run: Run) -> str:
    held: faultgate.Held = run.notes["held"]
    victim, uid, group = run.notes["victim"]
    log = run.pod_log(held.pod, run.notes["held_uid"])
    assert f"peer {victim}:" in log, f"{held.pod}'s log names no failure of {victim}"
    assert uid not in group_pods(run, group).values(), f"{victim} ({uid}) was not replaced"
    restarts = most_restarts(run, group)
    assert restarts >= 1, f"the operator counted no recreation of {group}"
    probed(run, 2)
    return (
        f"{_when(run)}: killed {victim} while {held.pod} pulled from it at READ "
        f"{held.done}/{held.batches}; {group} recreated ({restarts}x); {loaded(run)}"
    )


# ------------------------------------------------- the leader killed while its pods wait


def leader_killed_while_workers_wait(run: Run) -> None:
    """One group from storage: both pods loaded and held before they join; then the leader alone
    is held and the other pod let go into the rendezvous, where it waits for the leader; the
    leader is SIGKILLed. The operator recreates the group (both pods new) and it ends Ready."""
    _record(run)
    step = faultgate.GROUP_JOIN
    faultgate.hold_at(run.gate, run.name, step)
    try:
        deploy_groups(run, 1)
        run.wait("both pods held before joining", lambda: len(at_join(run)) == PODS, HOLD_TIMEOUT)
        held = at_join(run)
        group = _label(_pod(run, held[0]), LWS_NAME_LABEL)
        leader = _leader(run, group)
        workers = [p for p in held if p != leader]
        faultgate.hold_pod_at(run.gate, leader, step)
        faultgate.release_at(run.gate, run.name, step)
        run.wait("the other pods gone to the rendezvous", lambda: at_join(run) == [leader], 30.0)
        uids = group_pods(run, group)
        worker_pids = {p: run.stack.node.pids().get(f"{run.stack.namespace}/{p}") for p in workers}
        run.notes.update(group=group, leader=leader, workers=worker_pids, uids=uids)
        run.fault_at = time.monotonic()
        _kill(run, leader)
    finally:
        faultgate.disarm(run.gate, run.name)  # the restarted leader waits nowhere


def verify_leader_killed(run: Run) -> str:
    group, leader = run.notes["group"], run.notes["leader"]
    workers: dict[str, list[int]] = run.notes["workers"]
    old: dict[str, str] = run.notes["uids"]
    now = group_pods(run, group)
    kept = sorted(p for p, uid in old.items() if now.get(p) == uid)
    assert not kept, f"{kept} outlived the recreation of {group}"
    lingering = [pid for pids in workers.values() for pid in pids or [] if pid_alive(pid)]
    assert not lingering, f"the waiting pods' processes {lingering} are still alive"
    restarts = most_restarts(run, group)
    assert restarts >= 1, f"the operator counted no recreation of {group}"
    probed(run, 1)
    waited = ", ".join(workers)
    return (
        f"{_when(run)}: killed {leader} while {waited} waited for it to join; "
        f"{group} recreated ({restarts}x, {len(_uids(run, leader))} leader pods); {loaded(run)}"
    )


# --------------------------------------------------------- LWS recreates a group mid-pull


def lws_recreates_group_mid_pull(run: Run) -> None:
    """Two groups; while a target group's pod holds its pull open, its group's leader pod is
    deleted (an eviction, say): LWS recreates the group (the other pods go with their leader),
    and the new group pulls its ranks from the source group, which is left alone."""
    _record(run)
    faultgate.arm(run.gate, run.name)
    try:
        deploy_groups(run, 2)
        held = pull.held_pull(run)
        target = _label(_pod(run, held.pod), LWS_NAME_LABEL)
        source = _label(_pod(run, held.peer), LWS_NAME_LABEL)
        leader = _leader(run, target)
        run.notes.update(target=target, source=source, leader=leader, old=group_pods(run, target))
        run.notes["source_uids"] = group_pods(run, source)
        run.fault_at = time.monotonic()
        call(run.stack.kube.core.delete_namespaced_pod, leader, run.stack.namespace)
        # The held pod is stopped while it holds (with its leader, or as it), not after a
        # release lets its pull finish.
        run.wait(f"{held.pod} stopped mid-pull", lambda: not pid_alive(held.pid), GONE_TIMEOUT)
    finally:
        faultgate.disarm(run.gate, run.name)


def verify_lws_recreated(run: Run) -> str:
    held: faultgate.Held = run.notes["held"]
    target, source = run.notes["target"], run.notes["source"]
    old: dict[str, str] = run.notes["old"]
    now = group_pods(run, target)
    kept = sorted(p for p, uid in old.items() if now.get(p) == uid)
    assert not kept, f"{kept} outlived LWS's recreation of {target}"
    assert group_pods(run, source) == run.notes["source_uids"], f"{source}'s pods changed"
    rows = {r["name"]: r for r in run.replicas()}
    sources = [p["name"] for p in rows[source].get("pods") or []]
    got = [p.get("loadedFrom") for p in rows[target].get("pods") or []]
    assert got == [f"peer:{s}" for s in sources], f"{target} loaded from {got}, not {sources}"
    probed(run, 2)
    return (
        f"{_when(run)}: deleted {run.notes['leader']} while {held.pod} pulled at READ "
        f"{held.done}/{held.batches}; LWS recreated {target} (operator count "
        f"{most_restarts(run, target)}); {loaded(run)}"
    )


# ------------------------------------------------- a revision change while groups wait


def _standby_groups(run: Run) -> list[JSON]:
    return [r for r in run.replicas() if r.get("role") == "Target" and r.get("phase") == "Standby"]


def revision_changed_in_standby(run: Run) -> None:
    """Two groups of revision 1: the source group loads and is held before it joins (never
    Ready), so the target group waits in Standby; then the spec moves to revision 2 (other
    weights, same shapes) and the hold is let go once the operator has planned it. No group of
    revision 1 may be Ready from then on (the watcher counts any), and revision 2's groups
    answer with revision 2's weights."""
    _record(run)
    step = faultgate.GROUP_JOIN
    faultgate.hold_at(run.gate, run.name, step)
    try:
        deploy_groups(run, 2)
        run.wait(
            "the source group held before joining", lambda: len(at_join(run)) == PODS, HOLD_TIMEOUT
        )
        run.wait("a target group in Standby", lambda: bool(_standby_groups(run)))
        waiting = _standby_groups(run)
        old = str(waiting[0]["modelIdentity"])
        assert run.watch is not None
        run.watch.banned.add(old)
        run.notes.update(old=old, standby=[r["name"] for r in waiting], held=at_join(run))
        run.fault_at = time.monotonic()
        deploy_groups(run, 2, alt=True, revision="2")
        run.wait("revision 2 planned", run.planned)
    finally:
        faultgate.release_at(run.gate, run.name, step)


def verify_revision_changed(run: Run) -> str:
    old = run.notes["old"]
    identities = {str(r.get("modelIdentity")) for r in run.replicas()}
    assert old not in identities, f"a group of the old identity {old} is left"
    stale = [
        p["metadata"]["name"] for p in run.stack.pods(run.name) if _label(p, IDENTITY_LABEL) == old
    ]
    assert not stale, f"pods of the old identity {old} are left: {stale}"
    probed(run, 2)
    return (
        f"{_when(run)}: revision 2 while {', '.join(run.notes['standby'])} waited in Standby and "
        f"{', '.join(run.notes['held'])} held before joining; {old[:6]} -> "
        f"{', '.join(sorted(i[:6] for i in identities))}; {loaded(run)}"
    )


SCENARIOS: tuple[GroupScenario, ...] = (
    GroupScenario(
        "group-source-pod-sigkill-mid-pull",
        source_pod_killed_mid_pull,
        replicas=2,
        verify=verify_source_pod_killed,
        fast=True,  # `make test` sees a group fault strike a rank-matched pull
    ),
    GroupScenario(
        "group-leader-sigkill-while-workers-wait",
        leader_killed_while_workers_wait,
        replicas=1,
        verify=verify_leader_killed,
    ),
    GroupScenario(
        "group-lws-recreates-mid-pull",
        lws_recreates_group_mid_pull,
        replicas=2,
        verify=verify_lws_recreated,
    ),
    GroupScenario(
        "group-revision-changed-in-standby",
        revision_changed_in_standby,
        replicas=2,
        verify=verify_revision_changed,
    ),
)
