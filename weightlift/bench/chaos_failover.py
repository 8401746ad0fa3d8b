"""Chaos scenario: the active operator dies mid-rollout and its standby takes over.

Two operators run with leader election, as the chart's two replicas do (one holds the Lease and
reconciles, the other waits without starting kopf). Three replicas are deployed (a Source and
two Targets, all started at once) with the process node's fault gate holding the Source before
its storage load (worker/p2p/faultgate.py): no replica can be Ready, however fast the machine.
Once the status shows all three, the Source held and the Targets in Standby, the leader is
SIGKILLed (a node crash: no hand-off, its Lease has to run out); once the standby holds the
Lease the Source is let go. The scenario converges when the new leader has probed the source,
handed the Targets their peer and all three are Ready.
`verify` checks what a takeover must not do: create a replica pod twice (every pod's uid, from a
pod watch that began before the deployment), lose status (conditions' times, restarts, rows) or
give a pod another role; and it measures the takeover: the kill -> the new leader's acquireTime
-> its first reconcile pass (both stamped on the Lease by the new leader).
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client, watch

from weightlift.api.labels import DEPLOYMENT_LABEL, FIRST_RECONCILE_ANNOTATION, ROLE_LABEL
from weightlift.local.kube import KUBE_ERRORS, Kube, call, get_or_none
from weightlift.local.stack import LocalStack
from weightlift.operator.leader import ACQUIRE_JITTER
from weightlift.operator.settings import LeaderElection
from weightlift.worker.p2p import faultgate

if TYPE_CHECKING:
    from weightlift.bench.chaos_run import Run

JSON = dict[str, Any]
# What a takeover may take beyond the Lease's own bound (a loaded 2-core machine: the API
# server's answers and the new leader's first requests).
SLACK_SECONDS = 5.0
# The restarted old leader's retries watched for a take-back after it said it waits.
TRIES = 3


def election(stack: LocalStack) -> LeaderElection:
    """The chart's defaults (15 s lease, 10 s renew deadline, 2 s retry): the takeover measured
    is the one users get."""
    return LeaderElection(lease_name="weightlift-chaos", namespace=stack.namespace, identity="-")


def read_lease(stack: LocalStack) -> JSON | None:
    e = stack.election
    assert e is not None
    api = client.CoordinationV1Api(stack.kube.api)
    return get_or_none(api.read_namespaced_lease, e.lease_name, e.namespace)


def micro(text: str) -> float:
    """A Lease's MicroTime as seconds since the epoch."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class PodLedger(threading.Thread):
    """Every pod of a deployment the API server ever had, by name: the uids (a pod created twice
    has two) and the role labels it carried, from one list+watch stream."""

    def __init__(self, kubeconfig: Any, namespace: str, name: str) -> None:
        super().__init__(name=f"pod-ledger-{name}", daemon=True)
        self.kube = Kube(kubeconfig, "chaos-pod-ledger")
        self.namespace, self.selector = namespace, f"{DEPLOYMENT_LABEL}={name}"
        self.uids: dict[str, set[str]] = {}
        self.roles: dict[str, set[str]] = {}
        self._halt = threading.Event()
        self.ready = threading.Event()

    def _see(self, pod: JSON) -> None:
        meta = pod["metadata"]
        self.uids.setdefault(meta["name"], set()).add(meta["uid"])
        role = (meta.get("labels") or {}).get(ROLE_LABEL)
        if role:
            self.roles.setdefault(meta["name"], set()).add(role)

    def run(self) -> None:
        core = self.kube.core
        plain = client.ApiClient()  # turns the watch's model objects back into wire JSON
        while not self._halt.wait(0.1):  # a pause before each (re)list, after an error too
            with contextlib.suppress(*KUBE_ERRORS):
                listing = call(
                    core.list_namespaced_pod, self.namespace, label_selector=self.selector
                )
                for pod in listing["items"]:
                    self._see(pod)
                self.ready.set()
                version = listing["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    timeout_seconds=5,
                    _request_timeout=15,
                )
                for event in stream:
                    self._see(plain.sanitize_for_serialization(event["object"]))
                    if self._halt.is_set():
                        break

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        self.kube.close()


def leader_killed(run: Run) -> None:
    stack = run.stack
    # Identities of this run only: a Lease left by an earlier run names none of them.
    stamp = int(time.time())
    candidates = (f"operator-a-{stamp}", f"operator-b-{stamp}")
    run.notes["candidates"] = candidates
    stack.use_leader_election(election(stack), candidates)
    run.wait("a leader", lambda: _holder(stack) in candidates)
    ledger = PodLedger(stack.kubeconfig, stack.namespace, run.name)
    ledger.start()
    ledger.ready.wait(30)
    run.notes["ledger"] = ledger
    # Held from the deploy on: the rollout stops at a known step, not in a polled window.
    faultgate.hold_at(run.gate, run.name, faultgate.STORAGE_LOAD)
    run.deploy(replicas=3)
    run.wait("the source held before its load, 2 targets in Standby", lambda: _held(run, 3))
    lease = read_lease(stack) or {}
    md = stack.get_md(run.name) or {}
    rows = (md.get("status") or {}).get("replicaStatuses") or []
    run.notes.update(
        source=next(r["name"] for r in rows if r.get("role") == "Source"),
        leader=lease["spec"]["holderIdentity"],
        transitions=int(lease["spec"].get("leaseTransitions") or 0),
        renewed=micro(lease["spec"]["renewTime"]),
        status=md.get("status") or {},
        uids={p["metadata"]["name"]: p["metadata"]["uid"] for p in stack.pods(run.name)},
        phases={r["name"]: r.get("phase") for r in rows},
    )
    run.fault_at = time.monotonic()
    run.notes["killed_at"] = time.time()
    stack.kill_candidate(run.notes["leader"])
    # Replicas go on loading (Targets into Standby: no source is Ready) while the Lease runs out.
    survivor = next(c for c in candidates if c != run.notes["leader"])
    run.wait(f"{survivor} leading", lambda: _holder(stack) == survivor)
    faultgate.release_at(run.gate, run.name, faultgate.STORAGE_LOAD)


def _held(run: Run, replicas: int) -> bool:
    """Mid-rollout, as the old leader wrote it: every replica in the status, the one Source
    waiting at the gate, the Targets in Standby, none Ready (the gate makes this a state the
    rollout stays in, not a moment to catch)."""
    rows = run.replicas()
    if any(r.get("ready") for r in rows):
        raise AssertionError(f"a replica was Ready while its source was held: {rows}")
    waiting = {a.pod for a in faultgate.waiting_at(run.gate, run.name, faultgate.STORAGE_LOAD)}
    sources = {r["name"] for r in rows if r.get("role") == "Source"}
    targets = [r for r in rows if r.get("role") == "Target"]
    return (
        len(rows) == replicas
        and len(sources) == 1
        and sources == waiting
        and len(targets) == replicas - 1
        and all(r.get("phase") == "Standby" for r in targets)
    )


def _holder(stack: LocalStack) -> str:
    spec = (read_lease(stack) or {}).get("spec") or {}
    return str(spec.get("holderIdentity") or "")


def verify_leader_killed(run: Run) -> str:
    stack, notes = run.stack, run.notes
    ledger: PodLedger = notes["ledger"]
    try:
        return _verify(run, stack, notes, ledger)
    finally:
        ledger.stop()
        stack.use_leader_election(None)  # the plain operator again, for the next scenario


def _verify(run: Run, stack: LocalStack, notes: JSON, ledger: PodLedger) -> str:
    e = stack.election
    assert e is not None
    # The takeover, from the new leader's own stamps on the Lease.
    run.wait("the first reconcile stamped", lambda: _annotation(stack) is not None)
    lease = read_lease(stack) or {}
    spec = lease["spec"]
    survivor = spec["holderIdentity"]
    assert survivor != notes["leader"], f"{notes['leader']} still holds the Lease"
    assert int(spec["leaseTransitions"]) == notes["transitions"] + 1, spec
    acquired = micro(spec["acquireTime"]) - notes["killed_at"]
    first = micro(str(_annotation(stack))) - notes["killed_at"]
    # The Lease could change hands no sooner than it ran out (the old leader's last renewal
    # plus its duration); after that the standby's next try takes it, one retry period (with
    # jitter) later, plus what its requests take on a busy machine.
    expired = notes["renewed"] + e.lease_duration
    late = micro(spec["acquireTime"]) - expired
    bound = e.retry_period * (1 + ACQUIRE_JITTER) + SLACK_SECONDS
    assert late <= bound, f"the Lease changed hands {late:.1f}s after it ran out (> {bound:g})"
    notes["takeover"] = {"acquired": round(acquired, 2), "firstReconcile": round(first, 2)}
    # No replica pod created twice, none replaced: the pods at the kill are the pods now.
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in stack.pods(run.name)}
    twice = {n: sorted(u) for n, u in ledger.uids.items() if len(u) > 1}
    assert not twice, f"pods created more than once: {twice}"
    assert now == notes["uids"], f"pods at the kill {notes['uids']}, now {now}"
    # No wrong role: the source stayed Source, the Targets Targets (labels and status), and
    # the Targets pulled from it.
    rows = {r["name"]: r for r in run.replicas()}
    for name, uid in now.items():
        want = "Source" if name == notes["source"] else "Target"
        assert ledger.roles.get(name) == {want}, (
            f"{name} ({uid}) had roles {ledger.roles.get(name)}"
        )
        assert rows[name]["role"] == want, f"{name}: status role {rows[name]['role']}"
        if want == "Target":
            got = rows[name].get("loadedFrom")
            assert got == f"peer:{notes['source']}", f"{name} loaded from {got}"
    # No status lost: what the old leader wrote is still there (same Scheduled time, no restart).
    before, after = notes["status"], (stack.get_md(run.name) or {}).get("status") or {}
    times = {c["type"]: c.get("lastTransitionTime") for c in after.get("conditions") or []}
    for cond in before.get("conditions") or []:
        if cond["type"] == "Scheduled" and cond["status"] == "True":
            assert times.get("Scheduled") == cond.get("lastTransitionTime"), (cond, times)
    assert int(after.get("restarts") or 0) == 0, f"restarts {after.get('restarts')}"
    assert {r["name"] for r in before.get("replicaStatuses") or []} <= set(rows), before
    # The old leader comes back (its pod restarted): it waits, the Lease stays where it is.
    log = stack.candidate_log(notes["leader"])
    since = log.stat().st_size if log.exists() else 0  # the log is appended to: this life's
    stack.start_candidate(notes["leader"])
    # Its own word that it tried and found the Lease held; then the survivor's own renewals
    # (the Lease's renewTime, stamped by the API's clients, not our clock) show that it held on
    # through TRIES more of the standby's jittered retries. A take-back in that time, however
    # brief, raised leaseTransitions (never lowered): no sample can miss one.
    yielded = f"standby: Lease held by {survivor}"
    run.wait(f"{notes['leader']} back as a standby", lambda: yielded in _text(log, since))
    seen = micro((read_lease(stack) or {})["spec"]["renewTime"])
    span = TRIES * e.retry_period * (1 + ACQUIRE_JITTER)
    run.wait(
        f"{survivor} renewing for {span:.1f}s beside the standby",
        lambda: micro((read_lease(stack) or {})["spec"]["renewTime"]) >= seen + span,
    )
    spec = (read_lease(stack) or {})["spec"]
    assert spec["holderIdentity"] == survivor, f"the restarted {notes['leader']} took the Lease"
    assert int(spec["leaseTransitions"]) == notes["transitions"] + 1, (
        f"the Lease changed hands again after {notes['leader']} came back: {spec}"
    )
    assert "holds Lease" not in _text(log, since), f"{notes['leader']} took the Lease back"
    assert run.converged(3), "not converged after the old leader came back"
    return (
        f"takeover {first:.1f}s (Lease taken {acquired:.1f}s after the kill, lease "
        f"{e.lease_duration:g}s); {len(now)} pods, each created once; roles kept"
    )


def _text(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _annotation(stack: LocalStack) -> str | None:
    meta = (read_lease(stack) or {}).get("metadata") or {}
    value = (meta.get("annotations") or {}).get(FIRST_RECONCILE_ANNOTATION)
    return str(value) if value else None
