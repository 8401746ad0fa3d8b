"""Chaos scenarios for warm spares (spec.warmSpares): faults that strike while a spare waits.

A spare is a Target pod kept in Standby beyond `replicas`: labelled weightlift.dev/spare, handed
nothing, never Ready, left out of the scale subresource. Each scenario deploys one serving
replica and one spare, waits until the spare is warm (phase Spare in the status), then strikes:
the spare's node is lost, the scale subresource races up and down, or the model's revision
changes. Meanwhile `SpareWatch` follows every pod of the deployment and every version of its
status (two list+watch streams: no pod is too short-lived and no status too brief to see): a
spare counted Ready, two live pods of one identity on one replica index, an old spare handed
peers, the serving replica's Ready lost. `verify` checks those and what each scenario is about
once it has converged; the runner (chaos.py) counts orphans and wrong weights as for every
scenario.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    IDENTITY_LABEL,
    PEERS_ANNOTATION,
    REPLICA_LABEL,
    SPARE_LABEL,
)
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.bench.chaos_run import Run
from weightlift.local.kube import KUBE_ERRORS, Kube, call
from weightlift.local.processnode import ProcessNode

JSON = dict[str, Any]
# The node the spare of spare-node-lost runs on, and loses.
SPARE_NODE = "chaos-spare-node"
# A bound on a watch's threads (the runner stops them when the scenario ends).
WATCH_LIFETIME = 1200.0


# ------------------------------------------------------------------------- the watch


@dataclass
class PodSeen:
    """What one pod (one uid) was seen to be, over its life."""

    name: str
    replica: str
    identity: str
    node: str = ""
    spare: bool = False  # ever labelled a spare
    handed: bool = False  # ever carried a hand-off (peers or storage) while labelled a spare
    woken: bool = False  # a spare that lost its label: now a serving replica
    ready_as_spare: bool = False  # its Ready condition True while labelled a spare
    gone: bool = False  # seen terminating or deleted


@dataclass
class Sample:
    """The deployment's status as one version written to the API server says it."""

    at: float
    ready: int
    replicas: int
    spares: int


@dataclass
class SpareWatch:
    """The pods of one deployment (by uid) and every version of its status, each from a
    list+watch stream."""

    run: Run
    pods: dict[str, PodSeen] = field(default_factory=dict)
    twins: list[str] = field(default_factory=list)  # "identity/index: pod, pod" moments
    counted_ready: set[str] = field(default_factory=set)  # spare rows the status called ready
    ready_rows: dict[str, set[str]] = field(default_factory=dict)  # identity -> pods called ready
    samples: list[Sample] = field(default_factory=list)
    since: float = 0.0  # when the fault struck (monotonic)
    _live: dict[str, JSON] = field(default_factory=dict)  # uid -> pod, not terminating
    _halt: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _listed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> SpareWatch:
        for target in (self._watch_pods, self._watch_status):
            t = threading.Thread(target=target, name=f"spare-watch-{self.run.name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._listed.wait(30)
        return self

    def stop(self) -> None:
        self._halt.set()
        for t in self._threads:
            t.join(timeout=30)

    def _ended(self, started: float) -> bool:
        return self._halt.is_set() or time.monotonic() - started > WATCH_LIFETIME

    def _watch_pods(self) -> None:
        kube = Kube(self.run.stack.kubeconfig, "chaos-spare-watch")
        core, plain = kube.core, client.ApiClient()  # plain: model objects back to wire JSON
        selector, namespace = f"{DEPLOYMENT_LABEL}={self.run.name}", self.run.stack.namespace
        started = time.monotonic()
        try:
            while not self._ended(started):
                with contextlib.suppress(*KUBE_ERRORS):
                    listing = call(core.list_namespaced_pod, namespace, label_selector=selector)
                    self._relisted(listing["items"])
                    stream = watch.Watch().stream(
                        core.list_namespaced_pod,
                        namespace,
                        label_selector=selector,
                        resource_version=listing["metadata"]["resourceVersion"],
                        timeout_seconds=5,
                        _request_timeout=15,
                    )
                    for event in stream:
                        if event["type"] == "ERROR":  # e.g. 410 Gone: list again
                            break
                        pod = plain.sanitize_for_serialization(event["object"])
                        self._see(pod, deleted=event["type"] == "DELETED")
                        if self._ended(started):
                            break
                time.sleep(0.1)
        finally:
            kube.close()

    def _relisted(self, pods: list[JSON]) -> None:
        """A fresh list: what it lacks went while no watch was open."""
        listed = {p["metadata"]["uid"] for p in pods}
        for uid, seen in self.pods.items():
            seen.gone |= uid not in listed
        self._live.clear()
        for pod in pods:
            self._see(pod, deleted=False)
        self._listed.set()

    def _see(self, pod: JSON, deleted: bool) -> None:
        meta = pod["metadata"]
        labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
        uid = meta["uid"]
        seen = self.pods.setdefault(
            uid,
            PodSeen(meta["name"], labels.get(REPLICA_LABEL, ""), labels.get(IDENTITY_LABEL, "")),
        )
        seen.node = (pod.get("spec") or {}).get("nodeName") or seen.node
        if labels.get(SPARE_LABEL):
            seen.spare = True
            seen.handed |= bool(notes.get(PEERS_ANNOTATION))
            conditions = (pod.get("status") or {}).get("conditions") or []
            seen.ready_as_spare |= any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
            )
        elif seen.spare:
            seen.woken = True
        seen.gone |= deleted or bool(meta.get("deletionTimestamp"))
        if deleted or meta.get("deletionTimestamp"):
            self._live.pop(uid, None)
        else:
            self._live[uid] = pod
        self._check_twins()

    def _check_twins(self) -> None:
        """Two live pods of one identity on one replica index: a replica created twice."""
        by_index: dict[tuple[str, str], list[str]] = {}
        for uid in self._live:
            seen = self.pods[uid]
            by_index.setdefault((seen.identity, seen.replica), []).append(seen.name)
        for (identity, index), names in by_index.items():
            twin = f"{identity[:6]}/{index}: {', '.join(sorted(names))}"
            if len(names) > 1 and twin not in self.twins:
                self.twins.append(twin)

    def _watch_status(self) -> None:
        """Every version of the deployment the API server writes, from one list+watch stream
        (a watch resumed where it stopped: no version skipped between two reads)."""
        kube = Kube(self.run.stack.kubeconfig, "chaos-spare-status")
        custom, namespace = kube.custom, self.run.stack.namespace
        where = {"field_selector": f"metadata.name={self.run.name}"}
        started, version = time.monotonic(), ""
        try:
            while not self._ended(started):
                with contextlib.suppress(*KUBE_ERRORS):
                    if not version:  # first, or after the watch broke (e.g. 410 Gone)
                        listing = call(
                            custom.list_namespaced_custom_object,
                            GROUP,
                            VERSION,
                            namespace,
                            PLURAL,
                            **where,
                        )
                        for md in listing["items"]:
                            self._status(md)
                        version = listing["metadata"]["resourceVersion"]
                    stream = watch.Watch().stream(
                        custom.list_namespaced_custom_object,
                        GROUP,
                        VERSION,
                        namespace,
                        PLURAL,
                        resource_version=version,
                        timeout_seconds=5,
                        _request_timeout=15,
                        **where,
                    )
                    for event in stream:
                        md = event["object"]
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        version = md["metadata"]["resourceVersion"]
                        if event["type"] != "DELETED":
                            self._status(md)
                        if self._ended(started):
                            break
                time.sleep(0.1)
        finally:
            kube.close()

    def _status(self, md: JSON) -> None:
        status = md.get("status") or {}
        for row in status.get("replicaStatuses") or []:
            if row.get("spare") and (row.get("ready") or row.get("phase") == "Ready"):
                self.counted_ready.add(str(row.get("name")))
            if row.get("ready"):
                names = self.ready_rows.setdefault(str(row.get("modelIdentity")), set())
                names.add(str(row.get("name")))
        self.samples.append(
            Sample(
                time.monotonic(),
                int(status.get("readyReplicas") or 0),
                int(status.get("replicas") or 0),
                int(status.get("spares") or 0),
            )
        )

    # -- what the scenarios check
    def check_spares(self) -> None:
        """No spare was ever Ready (its pod's condition) or counted ready (the status), and no
        replica index of an identity ever had two live pods."""
        ready = sorted(s.name for s in self.pods.values() if s.ready_as_spare)
        assert not ready, f"spare pods Ready while labelled spares: {ready}"
        assert not self.counted_ready, f"spares counted ready: {sorted(self.counted_ready)}"
        assert not self.twins, f"two live pods on one replica index: {self.twins[:3]}"

    def min_ready_since(self, since: float) -> int:
        """The fewest Ready replicas any status said from `since` on (the version current then
        included: it held until the next one)."""
        before = [s.ready for s in self.samples if s.at < since][-1:]
        after = before + [s.ready for s in self.samples if s.at >= since]
        assert after, "no status seen since the fault"
        return min(after)


def _watch(run: Run) -> SpareWatch:
    found: SpareWatch = run.notes["spare_watch"]
    return found


def _started(run: Run) -> SpareWatch:
    spare_watch = SpareWatch(run).start()
    run.notes["spare_watch"] = spare_watch
    run.cleanups.append(spare_watch.stop)
    return spare_watch


def _spare_rows(run: Run) -> list[JSON]:
    return [r for r in run.replicas() if r.get("spare")]


def _serving(run: Run) -> list[JSON]:
    return [r for r in run.replicas() if r.get("ready") and not r.get("spare")]


def _warm(run: Run, replicas: int = 1) -> JSON:
    """Wait for `replicas` Ready and one warm spare; the spare's row, with its pod's uid."""
    run.wait(f"{replicas} Ready and a warm spare", lambda: run.converged(replicas, 1))
    (spare,) = _spare_rows(run)
    return {**spare, "uid": run.pod_uids()[spare["name"]]}


def _pod(run: Run, name: str) -> JSON:
    return next(p for p in run.stack.pods(run.name) if p["metadata"]["name"] == name)


def _live_uids(run: Run) -> dict[str, str]:
    """name -> uid of the deployment's pods, terminating ones left out."""
    pods = run.stack.pods(run.name)
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }


def _scale_status(run: Run) -> JSON:
    scale: JSON = call(
        run.stack.kube.custom.get_namespaced_custom_object_scale,
        GROUP,
        VERSION,
        run.stack.namespace,
        PLURAL,
        run.name,
    )
    return scale


def _check_scale(run: Run, replicas: int) -> None:
    """The scale subresource (what an HPA reads) counts and selects the serving pods only."""
    status = _scale_status(run)["status"]
    assert status["replicas"] == replicas, f"scale status.replicas {status['replicas']}"
    listing = call(
        run.stack.kube.core.list_namespaced_pod,
        run.stack.namespace,
        label_selector=status["selector"],
    )
    selected = {
        p["metadata"]["name"]
        for p in listing["items"]
        if not p["metadata"].get("deletionTimestamp")  # a scaled-down pod on its way out
    }
    serving = {r["name"] for r in _serving(run)}
    assert selected == serving, f"the scale selector picks {sorted(selected)}, serving {serving}"


# ------------------------------------------------------------------- the spare's node is lost


def spare_node_lost(run: Run) -> None:
    """One replica on the stack's node; a second process node joins, the first is cordoned,
    and warmSpares: 1 puts the spare there. Once it waits warm, its node is lost (every process
    killed, the Node deleted) and never comes back: the pod GC removes the orphaned pod, and the
    operator must make a new spare on the node left, while the serving replica stays Ready."""
    stack = run.stack
    run.deploy(replicas=1)
    run.wait("1 Ready", lambda: run.converged(1))
    run.notes["serving"] = run.pod_uids()
    node = ProcessNode(
        stack.kubeconfig,
        SPARE_NODE,
        stack.state_dir / "spare-node",
        gpus=stack.gpus,
        extra_env=dict(stack.worker_env),
        image_roots=dict(stack.image_roots),
    )
    spare_watch = _started(run)
    try:
        node.start()
        with _cordoned(run, stack.node_name):
            run.patch({"warmSpares": 1})
            spare = _warm_on(run, SPARE_NODE)
        run.notes["spare"] = spare
        run.notes["pids"] = node.pids().get(f"{stack.namespace}/{spare['name']}") or []
        assert run.notes["pids"], f"{spare['name']} has no process on {SPARE_NODE}"
        run.fault_at = spare_watch.since = time.monotonic()
    finally:
        node.stop(timeout=20.0)  # the fault, or the clean-up of a scenario that failed first


def _warm_on(run: Run, node: str) -> JSON:
    def there() -> bool:
        rows = _spare_rows(run)
        return len(rows) == 1 and rows[0].get("phase") == "Spare" and rows[0].get("node") == node

    run.wait(f"a warm spare on {node}", there)
    (spare,) = _spare_rows(run)
    return {**spare, "uid": run.pod_uids()[spare["name"]]}


@contextlib.contextmanager
def _cordoned(run: Run, node: str) -> Iterator[None]:
    """`node` unschedulable inside the block (kubectl cordon), schedulable again after it."""
    core = run.stack.kube.core
    call(core.patch_node, node, {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        call(core.patch_node, node, {"spec": {"unschedulable": False}})


def _alive(pid: int) -> bool:
    """A live process of that id (a zombie is dead: only its parent's wait is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def verify_spare_node_lost(run: Run) -> str:
    spare_watch = _watch(run)
    spare_watch.stop()
    spare_watch.check_spares()
    old = run.notes["spare"]
    (fresh,) = _spare_rows(run)
    uids = _live_uids(run)
    assert fresh["phase"] == "Spare", fresh
    assert uids[fresh["name"]] != old["uid"], f"{old['name']} ({old['uid']}) is still the spare"
    assert old["uid"] not in uids.values(), f"the lost spare's pod {old['name']} is still there"
    assert fresh.get("node") == run.stack.node_name, f"the new spare runs on {fresh.get('node')}"
    assert run.notes["serving"].items() <= uids.items(), "the serving replica's pod was replaced"
    alive = [pid for pid in run.notes["pids"] if _alive(pid)]
    assert not alive, f"the lost spare's processes {alive} outlived its node"
    low = spare_watch.min_ready_since(spare_watch.since)
    assert low >= 1, f"readyReplicas fell to {low} after the spare's node was lost"
    _check_scale(run, 1)
    return (
        f"{old['name']} lost with {SPARE_NODE}; new spare {fresh['name']} on "
        f"{fresh.get('node')}; serving replica Ready throughout"
    )


# --------------------------------------------------------------- scale-up and -down racing


RACE = (3, 1, 2)  # each patched as soon as the operator has planned the one before


def spare_scale_race(run: Run) -> None:
    """One replica and a warm spare; the scale subresource goes 1 -> 3 -> 1 -> 2, each patch
    as soon as the operator has acted on the one before (its observedGeneration): the spare
    woken, new pods created and loading when the scale-down strikes, pods terminating when
    the last scale-up does."""
    run.deploy(replicas=1, warm_spares=1)
    spare = _warm(run)
    run.notes["spare"] = spare
    _started(run)
    run.fault_at = time.monotonic()
    for replicas in RACE:
        run.scale(replicas)
        generation = int((run.stack.get_md(run.name) or {})["metadata"]["generation"])
        run.wait(f"generation {generation} planned", _planned(run, generation))


def _planned(run: Run, generation: int) -> Callable[[], bool]:
    """The operator has planned `generation` (its status says so)."""

    def planned() -> bool:
        md = run.stack.get_md(run.name) or {}
        return int((md.get("status") or {}).get("observedGeneration") or 0) >= generation

    return planned


def verify_spare_scale_race(run: Run) -> str:
    spare_watch = _watch(run)
    spare_watch.stop()
    spare_watch.check_spares()
    final = RACE[-1]
    _check_scale(run, final)
    status = (run.stack.get_md(run.name) or {}).get("status") or {}
    assert status.get("replicas") == final, f"status.replicas {status.get('replicas')}"
    peak = max((s.replicas for s in spare_watch.samples), default=0)
    spare = run.notes["spare"]
    kept = next((r for r in run.replicas() if r["name"] == spare["name"]), None)
    fate = "gone" if kept is None else ("serving" if kept.get("ready") else kept.get("phase"))
    # A name may come back (names derive from the index) once its pod is gone: counted, not
    # refused; two live at once is what check_spares refuses.
    names = [seen.name for seen in spare_watch.pods.values()]
    reused = len(names) - len(set(names))
    return (
        f"1->{'->'.join(map(str, RACE))}: {len(names)} pods in all ({reused} names reused), "
        f"none twice live on an index; status.replicas peaked at {peak}; first spare {fate}"
    )


# ------------------------------------------------------------------- the revision changes


def spare_revision_changed(run: Run) -> None:
    """One replica and a warm spare of revision 1; the spec moves to revision 2 (other files,
    other weights, same shapes). The old spare must go without being handed anything, and a
    spare of the new identity wait in its place. Of revision 1 only the replica serving at the
    change may be Ready (until revision 2's is), and every Ready replica answers with the
    weights of the identity it is labelled with (the watcher probes each with its own)."""
    run.deploy(replicas=1, warm_spares=1)
    spare = _warm(run)
    run.notes["spare"] = spare
    run.notes["serving"] = {r["name"] for r in _serving(run)}
    alt, probe = run.models.alt()
    assert run.watch is not None
    # The serving replica of revision 1 keeps serving until one of revision 2 is Ready (a
    # rollout): each replica must answer with the weights of the identity it is labelled with.
    run.watch.probes[spare["modelIdentity"]] = run.models.probe
    run.watch.probe = probe
    _started(run)
    run.fault_at = time.monotonic()
    run.deploy(alt, replicas=1, revision="2", probe=probe, warm_spares=1)


def verify_spare_revision_changed(run: Run) -> str:
    spare_watch = _watch(run)
    spare_watch.stop()
    spare_watch.check_spares()
    old = run.notes["spare"]
    identity = str(((run.stack.get_md(run.name) or {}).get("status") or {}).get("modelIdentity"))
    assert identity != old["modelIdentity"], "the status still names the old identity"
    (fresh,) = _spare_rows(run)
    pod = _pod(run, fresh["name"])
    assert pod["metadata"]["uid"] != old["uid"], f"{old['name']} is still the spare"
    label = pod["metadata"]["labels"].get(IDENTITY_LABEL)
    assert label == identity == fresh["modelIdentity"], f"the new spare is labelled {label}"
    seen = spare_watch.pods.get(old["uid"])
    assert seen is not None and seen.gone, f"the old spare {old['name']} was never deleted"
    assert not seen.handed, f"the old spare {old['name']} was handed peers or storage"
    assert not seen.woken, f"the old spare {old['name']} was woken as a serving replica"
    # Of revision 1 only the replica serving at the change was ever Ready.
    old_ready = spare_watch.ready_rows.get(old["modelIdentity"], set())
    assert old_ready <= run.notes["serving"], f"Ready of the old identity: {sorted(old_ready)}"
    assert all(r.get("modelIdentity") == identity for r in run.replicas()), run.replicas()
    return (
        f"spare {old['name']} ({old['modelIdentity'][:6]}) replaced unhanded by "
        f"{fresh['name']} ({identity[:6]})"
    )
