"""Chaos scenarios for standby: faults that strike while Targets wait in phase Standby.

Every pod of a deployment starts at once; a Target prepares and then waits in Standby until the
operator hands it peers (the weightlift.dev/peers annotation, projected into a file the worker
watches) or storage. To see that wait whatever the machine's speed, each scenario holds the
source at the process node's fault gate from before the deploy (worker/p2p/faultgate.py:
STORAGE_LOAD): its worker runs, its front door answers and its liveness passes, but it loads
nothing until released, so no source is Ready and the Targets stay in Standby, a state and not
a moment to catch. Once the status shows a Target there, the fault strikes: the source dies,
the revision changes, the wait for a source runs out, the deployment scales down, or someone
hands the Target a pod of another model identity. `bench/chaos.py` runs them as it runs the
others (converged, seconds, orphans, wrong weights); `verify` functions check what each
scenario is about once it has converged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import TracebackType
from typing import Any

import httpx

from weightlift.api.labels import PEERS_ANNOTATION, REPLICA_LABEL
from weightlift.api.worker import PeerCandidate, PeerHandoff
from weightlift.bench.chaos_run import Run, pod_ports
from weightlift.local.kube import MERGE, call
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
# A deadline for the source to start and reach the gate (a loaded 2-core machine: seconds).
HOLD_TIMEOUT = 240.0
# A wait for a source short enough to run out in the scenario, long enough that a Target on a
# loaded 2-core machine reaches Standby first (a Target reached it in a few seconds there).
SHORT_WAIT_SECONDS = 20


class HeldSource:
    """Replica 0 of the run's deployment, held at the fault gate before its storage load from
    before the deploy (enter the block, then deploy, then `wait`): its Targets wait for it
    however fast it would have loaded. `resume` (or leaving the block) lets it load; `kill` is
    its SIGKILL, and lets go of the gate so that its replacement loads."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.pod, self.uid = "", ""
        self.pids: list[int] = []

    def __enter__(self) -> HeldSource:
        faultgate.hold_at(self.run.gate, self.run.name, faultgate.STORAGE_LOAD)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.resume()

    def wait(self) -> HeldSource:
        """Wait until the source waits at the gate (the deploy is done): its pod, uid, pids."""
        found: list[faultgate.AtStep] = []

        def held() -> bool:
            found[:] = faultgate.waiting_at(self.run.gate, self.run.name, faultgate.STORAGE_LOAD)
            return bool(found)

        self.run.wait("the source held before its storage load (fault gate)", held, HOLD_TIMEOUT)
        assert len(found) == 1, f"more than one pod held before its storage load: {found}"
        at = found[0]
        pod = next(p for p in self.run.stack.pods(self.run.name) if p["metadata"]["name"] == at.pod)
        meta = pod["metadata"]
        replica = meta["labels"].get(REPLICA_LABEL)
        assert replica == "0", f"{at.pod} (replica {replica}) holds, not replica 0"
        pids = self.run.stack.node.pids().get(f"{meta['namespace']}/{at.pod}") or []
        assert at.pid in pids, f"{at.pod}: the held worker {at.pid} is none of its pods' {pids}"
        self.pod, self.uid, self.pids = at.pod, meta["uid"], list(pids)
        return self

    def resume(self) -> None:
        faultgate.release_at(self.run.gate, self.run.name, faultgate.STORAGE_LOAD)

    def kill(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids = []
        self.resume()


def standby_rows(run: Run) -> list[JSON]:
    return [r for r in run.replicas() if r.get("role") == "Target" and r.get("phase") == "Standby"]


def wait_standby(run: Run, count: int = 1) -> list[JSON]:
    """Wait until `count` Targets are in phase Standby (the status says so); their rows."""
    run.wait(f"{count} target(s) in Standby", lambda: len(standby_rows(run)) >= count)
    rows = standby_rows(run)
    run.notes["standby"] = [r["name"] for r in rows]
    return rows


def _loaded_from(run: Run) -> str:
    """Replica <- where it loaded from, pod names shortened to their replica index's tail."""
    return ", ".join(
        f"{r.get('replica')}<-{str(r.get('loadedFrom')).replace(run.name + '-', '')}"
        for r in run.replicas()
    )


def _events(run: Run, name: str) -> set[str]:
    return {str(e.get("reason")) for e in run.stack.events(name)}


# ----------------------------------------------------------------------- the source dies


def source_dies(run: Run) -> None:
    """Three replicas; the source is SIGKILLed (held before its load: it never served) while
    both Targets wait: the operator replaces it and hands the Targets the new source (or
    storage)."""
    with HeldSource(run) as source:
        run.deploy(replicas=3)
        source.wait()
        wait_standby(run, 2)
        run.notes["dead"] = (source.pod, source.uid)
        run.fault_at = time.monotonic()
        source.kill()


def verify_source_dies(run: Run) -> str:
    """The dead pod is replaced (its name may come back: names derive from the index)."""
    dead, uid = run.notes["dead"]
    uids = {p["metadata"]["uid"] for p in run.stack.pods(run.name)}
    assert uid not in uids, f"the dead source {dead} ({uid}) is still a pod"
    return f"source {dead} killed, replaced; loaded: {_loaded_from(run)}"


# ------------------------------------------------------------------- the revision changes


def revision_changes(run: Run) -> None:
    """Two replicas of revision 1; while the Target waits, the spec moves to revision 2 (other
    files, other weights, same shapes) and the held source is let go once the operator has
    planned it. No replica may be Ready with revision 1's weights from then on: the watcher
    counts any Ready row of the old identity, and probes the others with revision 2's expected
    output."""
    with HeldSource(run) as source:
        run.deploy(replicas=2)
        source.wait()
        rows = wait_standby(run, 1)
        old = rows[0]["modelIdentity"]
        alt, probe = run.models.alt()
        assert run.watch is not None
        run.watch.banned.add(old)
        run.watch.probe = probe
        run.notes["old"] = old
        run.fault_at = time.monotonic()
        run.deploy(alt, replicas=2, revision="2", probe=probe)
        # Let go once the operator has planned revision 2 (the held source is then an old
        # replica that was never Ready), not in a race with that plan.
        run.wait("revision 2 planned", run.planned)
        source.resume()


def verify_revision_changes(run: Run) -> str:
    old = run.notes["old"]
    identities = {str(r.get("modelIdentity")) for r in run.replicas()}
    assert old not in identities, f"a replica of the old identity {old} is left"
    return f"identity {old[:6]} -> {', '.join(sorted(i[:6] for i in identities))}"


# ------------------------------------------------------------ waitForSourceSeconds expires


def wait_expires(run: Run) -> None:
    """Two replicas, a short `waitForSourceSeconds`, the source held throughout: the Target
    waits in Standby, the wait runs out, and the operator hands it storage (and the Source
    role); it is Ready from storage while the source still waits at the gate."""
    with HeldSource(run) as source:
        run.deploy(replicas=2, wait_for_source_seconds=SHORT_WAIT_SECONDS)
        source.wait()
        run.wait("a target in Standby", lambda: _standby_before_expiry(run))
        target = standby_rows(run)[0]["name"]
        run.notes["target"] = target
        run.fault_at = time.monotonic()
        run.wait(
            f"{target} Ready from storage while its source is held",
            lambda: bool(run.row(target).get("ready")),
        )
        held = faultgate.waiting_at(run.gate, run.name, faultgate.STORAGE_LOAD)
        assert [a.pod for a in held] == [source.pod], f"the source let go before the end: {held}"


def _standby_before_expiry(run: Run) -> bool:
    if standby_rows(run):
        return True
    expired = [r for r in run.replicas() if r.get("replica") != 0 and r.get("role") == "Source"]
    if expired:
        raise AssertionError(
            f"the {SHORT_WAIT_SECONDS}s wait ran out before a Target reached Standby "
            f"({expired[0]['name']} is {expired[0].get('phase')}): a slow machine; raise the wait"
        )
    return False


def verify_wait_expires(run: Run) -> str:
    target = run.notes["target"]
    row = run.row(target)
    assert row.get("role") == "Source", f"{target} is still a {row.get('role')}"
    got = str(row.get("loadedFrom"))
    assert got.startswith("storage:"), f"{target} loaded from {got}, not storage"
    reasons = _events(run, run.name)
    assert "WaitForSourceExpired" in reasons, f"no WaitForSourceExpired event ({sorted(reasons)})"
    return f"{target} <- {got} after {SHORT_WAIT_SECONDS}s without a source"


# ----------------------------------------------------------------- scale-down in standby


def scale_down_in_standby(run: Run) -> None:
    """Three replicas, both Targets waiting, the source held: scaled to 2, the operator
    removes a waiting Target, never the (not yet Ready) source; the other Target then pulls."""
    with HeldSource(run) as source:
        run.deploy(replicas=3)
        source.wait()
        wait_standby(run, 2)
        run.notes["source"] = source.pod
        run.fault_at = time.monotonic()
        run.scale(2)
        run.wait("one pod removed", lambda: len(_live_pods(run)) == 2)
        kept = _live_pods(run)
        assert kept.get(source.pod) == source.uid, (
            f"scale-down removed the source {source.pod} ({source.uid}), kept {kept}"
        )


def _live_pods(run: Run) -> dict[str, str]:
    """name -> uid of the deployment's pods, terminating ones left out."""
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in run.stack.pods(run.name)
        if not p["metadata"].get("deletionTimestamp")
    }


def verify_scale_down(run: Run) -> str:
    source = run.notes["source"]
    names = {r["name"] for r in run.replicas()}
    gone = sorted(set(run.notes["standby"]) - names)
    assert source in names and len(gone) == 1, f"kept {sorted(names)}; source {source}"
    return f"removed {gone[0]} (in Standby), kept the source; loaded: {_loaded_from(run)}"


# ------------------------------------------------------- a peer of another model identity


def foreign_peer(run: Run) -> None:
    """A Ready replica of another deployment, another revision and other weights (same shapes)
    is handed to a waiting Target, forged into its annotation while the operator is down (so
    only the forgery reaches it): the Target tries it, is refused (identity and peer token
    differ), loads from storage and serves its own weights."""
    alt, probe = run.models.alt()
    foreign = f"{run.name}f"  # not "<name>-...": its pods are no pods of this deployment
    run.others.append(foreign)
    run.deploy(alt, replicas=1, name=foreign, revision="2", probe=probe)
    run.wait(f"{foreign} Ready", lambda: _phase(run, foreign) == "Ready")
    peer = _endpoint(run, foreign)
    with HeldSource(run) as source:
        run.deploy(replicas=2)
        source.wait()
        target = wait_standby(run, 1)[0]
        mine = _endpoint(run, run.name, target["name"])
        run.notes.update(target=target["name"], foreign=peer.pod)
        run.stack.kill_operator()
        try:
            run.fault_at = time.monotonic()
            handoff = PeerHandoff(peers=[peer])
            call(
                run.stack.kube.core.patch_namespaced_pod,
                target["name"],
                run.stack.namespace,
                {"metadata": {"annotations": {PEERS_ANNOTATION: handoff.to_text()}}},
                _content_type=MERGE,
            )
            run.notes["report"] = _served(run, f"http://{mine.address}/weightlift/v1/status")
        finally:
            run.stack.restart_operator()


def _phase(run: Run, name: str) -> str:
    md = run.stack.get_md(name) or {}
    return str((md.get("status") or {}).get("phase"))


def _endpoint(run: Run, deployment: str, pod: str | None = None) -> PeerCandidate:
    """host:port of a pod's worker (the first Ready replica of `deployment` when no `pod`)."""
    md = run.stack.get_md(deployment) or {}
    rows = (md.get("status") or {}).get("replicaStatuses") or []
    row = next((r for r in rows if (r["name"] == pod if pod else r.get("ready"))), None)
    ports = pod_ports(run.stack.kube, run.stack.namespace, deployment)
    assert row is not None and row.get("podIP"), f"{deployment}: no pod {pod or 'Ready'} with an IP"
    assert row["name"] in ports, f"{row['name']}: no container port"
    return PeerCandidate(pod=row["name"], address=f"{row['podIP']}:{ports[row['name']]}")


def _served(run: Run, status_url: str) -> JSON:
    """The worker's own report once it serves (or fails): the operator is down meanwhile."""
    report: JSON = {}

    def done() -> bool:
        nonlocal report
        with contextlib.suppress(httpx.HTTPError, ValueError):
            report = httpx.get(status_url, timeout=5).json()
        return report.get("phase") in ("Serving", "Failed")

    run.wait("the target serving after the forged hand-off", done)
    return report


def verify_foreign_peer(run: Run) -> str:
    target, foreign, report = run.notes["target"], run.notes["foreign"], run.notes["report"]
    got = report.get("loadedFrom")
    assert report.get("phase") == "Serving" and str(got).startswith("storage:"), report
    text = run.pod_log(target)
    assert f"peer {foreign}" in text, f"{target} never tried the forged peer {foreign}"
    assert "falling back to storage" in text, f"{target}'s log shows no refusal of {foreign}"
    return f"{target} refused {foreign} (another identity), loaded from {got}"
