"""Faults only a real node has (`weightlift bench chaos --node kubelet`): the stack's node is the
pinned kubelet with containerd (local/kubeletnode/), the workers are containers of the worker
image under a memory limit.

Each scenario deploys two replicas with the node's fault gate armed (worker/p2p/faultgate.py,
which the node's device plugin mounts into every worker container): the Target holds its pull
from the Source open mid-transfer, and the fault strikes then, on that event, never on a poll
for a window:
- oom-killed-while-loading: the held worker's memory cgroup filled to its own limit (a helper
  process charged to that cgroup; the worker's oom_score_adj raised so the kernel picks it):
  the kernel's OOM killer kills the worker, the kubelet reports OOMKilled, the operator replaces
  the pod;
- kubelet-restart-mid-pull, containerd-restart-mid-pull: the daemon stopped and started again;
  the containers run on and the pull finishes from the same peer;
- drained-holding-the-only-source: the node cordoned and every pod on it evicted (as `kubectl
  drain` does), the Source, the only one, among them; once the operator's replacements wait
  Unschedulable (watched), the node is uncordoned and the deployment loads again from storage;
- node-rebooted-mid-pull: every process of the node killed at once, its mounts and runtime
  state gone, then the daemons start again (KubeletNode.reboot); the pods run again.

Then the chaos harness (bench/chaos.py) waits for convergence, watches for wrong weights
(bench/chaos_run.py) and counts orphans: pods, running containers and every container process
the scenario saw. Each `verify` says when and where the fault struck.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weightlift.api.podspec import WORKER_CONTAINER
from weightlift.bench.chaos_pull import held_pull
from weightlift.bench.chaos_run import CONVERGE_TIMEOUT, JSON, Run, ScenarioSkipped, started
from weightlift.local.history import History, Version
from weightlift.local.kube import KUBE_ERRORS, call
from weightlift.local.kubeletnode import KubeletNode, teardown
from weightlift.local.stack import LocalStack, engine_image, model_deployment
from weightlift.worker.p2p import faultgate

# The worker containers' memory limit here: what an idle worker holds (torch, NIXL, the demo
# model) with room to spare, so only the injected fault reaches it.
MEMORY_LIMIT = "3Gi"
DOWN_SECONDS = 3.0
# The OOM helper allocates at most this far past the limit before it gives up (no kill came).
HOG_MARGIN = 512 << 20

# Joins the memory cgroup given, then allocates (and touches) 16 MiB at a time until every
# victim pid is gone (exit 0) or it holds the cap (exit 3: the kernel killed no victim). The
# victims' oom_score_adj of 1000 outweighs any helper of a limit's size (the kernel adds
# adj/1000 of the limit to a task's pages).
HOG = r"""
import os, sys
cgroup, cap, victims = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

held = []
while any(alive(p) for p in victims):
    if len(held) * (16 << 20) >= cap:
        sys.exit(3)
    held.append(b"\x01" * (16 << 20))
"""


@dataclass(frozen=True)
class NodeFault:
    """One scenario: `inject` strikes (bench/chaos.py's Scenario runs it), `verify` checks it
    hit what it is about and says when and where."""

    name: str
    inject: Callable[[Run], None]
    verify: Callable[[Run], str]
    replicas: int = 2
    fast: bool = False  # the one `make test` runs (tests/e2e/test_kubelet_service_readiness.py)


def node_of(run: Run) -> KubeletNode:
    node = run.stack.node
    if not isinstance(node, KubeletNode):
        kind = type(node).__name__
        raise ScenarioSkipped(f"a real node's fault: run it with --node kubelet (not a {kind})")
    return node


def prepare(stack: LocalStack) -> None:
    """The worker image pulled and unpacked before the first scenario (minutes, once): a
    Target's wait for its source must not be spent on it."""
    node = stack.node
    assert isinstance(node, KubeletNode)
    node.crictl("pull", engine_image("Builtin"), timeout=1800)


def deploy_limited(run: Run, replicas: int) -> None:
    """`replicas` of the chaos model, the worker container limited to MEMORY_LIMIT."""
    manifest = model_deployment(
        run.name,
        run.models.model,
        replicas=replicas,
        probe=run.models.probe,
        probe_period_seconds=1,
        wait_for_source_seconds=120,
    )
    manifest["spec"]["template"]["resources"] = {"limits": {"memory": MEMORY_LIMIT}}
    run.stack.apply(manifest)


@contextlib.contextmanager
def held_target(run: Run, replicas: int = 2) -> Iterator[faultgate.Held]:
    """Deploy with the gate armed; inside the block the Target holds its pull from the Source
    mid-transfer (where it stands is noted for `struck`); leaving it lets the pull go on."""
    faultgate.arm(run.gate, run.name)
    try:
        run.notes["applied"] = time.monotonic()
        deploy_limited(run, replicas)
        held = held_pull(run)
        run.notes["pids"] = run.worker_pids()
        run.notes["containers"] = _containers(run)
        run.fault_at = time.monotonic()
        yield held
    finally:
        faultgate.disarm(run.gate, run.name)


def struck(run: Run) -> str:
    """When and where: the held pod, how far its pull was, its peer; seconds after the apply."""
    held: faultgate.Held = run.notes["held"]
    at = run.fault_at - run.notes["applied"]
    pod, peer = (p.removeprefix(f"{run.name}-") for p in (held.pod, held.peer))
    return f"{pod} at READ {held.done}/{held.batches} <- {peer} +{at:.0f}s"


def _containers(run: Run) -> set[str]:
    """The ids of this deployment's running containers on the node."""
    prefix = f"{run.name}-"
    return {
        c["id"]
        for c in node_of(run).containers()
        if str((c.get("labels") or {}).get("io.kubernetes.pod.name")).startswith(prefix)
    }


def _loaded(run: Run) -> str:
    """How the replicas loaded (storage, peer), once the weights watch has asked each Ready
    one the probe: 0 wrong weights then means each answered right."""
    watch = run.watch
    assert watch is not None

    def probed() -> bool:
        return {str(r["name"]) for r in run.replicas() if r.get("ready")} <= watch.checked

    run.wait("the weights watch to probe every Ready replica", probed)
    return ",".join(str(r.get("loadedFrom")).split(":")[0] for r in run.replicas())


# ------------------------------------------------------------------------------ OOM kill


def container_of(node: KubeletNode, namespace: str, pod: str) -> JSON:
    """The pod's running worker container."""
    for c in node.containers():
        labels = c.get("labels") or {}
        if (
            labels.get("io.kubernetes.pod.namespace") == namespace
            and labels.get("io.kubernetes.pod.name") == pod
            and labels.get("io.kubernetes.container.name") == WORKER_CONTAINER
        ):
            return c
    raise AssertionError(f"{namespace}/{pod} runs no {WORKER_CONTAINER} container")


def memory_cgroup(node: KubeletNode, container_id: str) -> Path:
    found = [
        d
        for top in teardown.cgroup_dirs(node.cgroup_root)
        if top.parent.name == "memory"
        for d in top.rglob(container_id)
        if d.is_dir()
    ]
    assert len(found) == 1, f"container {container_id[:12]}: memory cgroups {found}"
    return found[0]


def oom_killed_reason(version: Version) -> str | None:
    """The worker container's termination as the kubelet reported it, if OOMKilled."""
    for cs in version.status.get("containerStatuses") or []:
        for state in ("state", "lastState"):
            done = (cs.get(state) or {}).get("terminated") or {}
            if done.get("reason") == "OOMKilled":
                return f"OOMKilled exit {done.get('exitCode')}"
    return None


def oom_while_loading(run: Run) -> None:
    node = node_of(run)
    ns = run.stack.namespace
    with held_target(run) as held, History.pods(run.stack.kubeconfig, ns, run.name) as pods:
        container = container_of(node, ns, held.pod)
        cgroup = memory_cgroup(node, container["id"])
        limit = int((cgroup / "memory.limit_in_bytes").read_text())
        victims = node.container_pids(container["id"])
        assert victims, f"{held.pod}: no processes in {cgroup}"
        for pid in victims:  # the kernel picks the worker, never the helper
            Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
        run.fault_at = time.monotonic()
        argv = [sys.executable, "-c", HOG, str(cgroup), str(limit + HOG_MARGIN)]
        hog = subprocess.Popen([*argv, *map(str, victims)])

        def tick() -> None:
            run.stack.check_operator()
            alive = [p for p in victims if started(p) is not None]
            if hog.poll() is not None and alive:
                raise AssertionError(f"the helper ended ({hog.returncode}); {alive} live on")

        try:
            killed = pods.wait(
                lambda v: v.name == held.pod and oom_killed_reason(v) is not None,
                CONVERGE_TIMEOUT,
                f"{held.pod} OOMKilled",
                tick=tick,
            )
            code = hog.wait(timeout=60)
        finally:
            if hog.poll() is None:
                hog.kill()
                hog.wait()
        # Killed itself after the worker is fine (what the dead worker left in tmpfs stays
        # charged); at its cap, the kernel killed no worker.
        assert code != 3, f"the helper filled {cgroup} past its limit and no worker was killed"
        run.notes.update(oom=oom_killed_reason(killed), limit=limit)


def verify_oom(run: Run) -> str:
    held: faultgate.Held = run.notes["held"]
    run.worker_pids()
    new_uid = run.pod_uids().get(held.pod)
    assert new_uid != run.notes["held_uid"], f"{held.pod} was not replaced after its OOM kill"
    mib = run.notes["limit"] >> 20
    return f"{struck(run)}: {run.notes['oom']} at {mib}Mi; replaced, loaded {_loaded(run)}"


# ------------------------------------------------------------- daemons restarted mid-pull


def daemon_restarted(daemon: str) -> Callable[[Run], None]:
    """The node's `daemon` (kubelet or containerd) stopped and started again while the Target
    holds its pull; the pull goes on once the node is back."""

    def inject(run: Run) -> None:
        node = node_of(run)
        restart = {"kubelet": node.restart_kubelet, "containerd": node.restart_containerd}
        with held_target(run):
            before = node.pid(daemon)
            restart[daemon](DOWN_SECONDS)
            run.notes["daemon"] = (daemon, before, node.pid(daemon))

    return inject


def verify_daemon_restarted(run: Run) -> str:
    """The containers outlived the daemon's restart, and the held Target finished its pull
    from the same peer."""
    held: faultgate.Held = run.notes["held"]
    daemon, before, after = run.notes["daemon"]
    assert before != after, f"{daemon} kept pid {before}"
    run.worker_pids()
    lost = run.notes["containers"] - _containers(run)
    assert not lost, f"containers {sorted(lost)} died with {daemon}'s restart"
    assert run.pod_uids().get(held.pod) == run.notes["held_uid"], f"{held.pod} was replaced"
    got = run.row(held.pod).get("loadedFrom")
    assert got == f"peer:{held.peer}", f"{held.pod} loaded {got}, not from {held.peer}"
    return f"{struck(run)}: {daemon} {before}->{after}; containers kept; {_loaded(run)}"


# ------------------------------------------------------------------------ cordon and drain


def _cordon(run: Run, unschedulable: bool) -> None:
    patch = {"spec": {"unschedulable": unschedulable or None}}
    call(run.stack.kube.core.patch_node, run.stack.node_name, patch)


def _evict_all(run: Run) -> list[str]:
    """What `kubectl drain --ignore-daemonsets` evicts: every pod on the node not owned by a
    DaemonSet, through the Eviction API (PodDisruptionBudgets apply)."""
    core = run.stack.kube.core
    on_node = f"spec.nodeName={run.stack.node_name}"
    pods = call(core.list_pod_for_all_namespaces, field_selector=on_node)["items"]
    evicted = []
    for pod in pods:
        meta = pod["metadata"]
        if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
            continue
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        }
        call(core.create_namespaced_pod_eviction, meta["name"], meta["namespace"], body)
        evicted.append(meta["name"])
    return evicted


def unschedulable(version: Version) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in version.status.get("conditions") or []
    )


def evicted_by_api(version: Version) -> bool:
    return any(
        c.get("type") == "DisruptionTarget" and c.get("reason") == "EvictionByEvictionAPI"
        for c in version.status.get("conditions") or []
    )


def drained(run: Run) -> None:
    node_of(run)
    ns = run.stack.namespace
    run.cleanups.append(lambda: _uncordon_quietly(run))
    with History.pods(run.stack.kubeconfig, ns, run.name) as pods:
        with held_target(run) as held:
            old = set(run.pod_uids().values())
            source = held.peer
            _cordon(run, True)
            run.notes["evicted"] = _evict_all(run)
        gone: set[str] = set()
        parked: set[str] = set()

        def drained_and_parked(v: Version) -> bool:
            if v.type == "DELETED":
                gone.add(v.uid)
            if v.uid not in old and unschedulable(v):
                parked.add(v.name)
            return old <= gone and bool(parked)

        pods.wait(drained_and_parked, CONVERGE_TIMEOUT, "drained", tick=run.stack.check_operator)
        run.notes["source_evicted"] = any(
            v.name == source and evicted_by_api(v) for v in pods.versions()
        )
        run.notes.update(source=source, parked=sorted(parked))
        _cordon(run, False)


def _uncordon_quietly(run: Run) -> None:
    with contextlib.suppress(*KUBE_ERRORS):
        _cordon(run, False)


def verify_drained(run: Run) -> str:
    """The only Source was evicted by the drain, the replacements waited Unschedulable while
    the node was cordoned, and the deployment loaded again: one Source from storage."""
    assert run.notes["source_evicted"], f"{run.notes['source']} shows no eviction"
    run.worker_pids()
    rows = run.replicas()
    storage = [r for r in rows if str(r.get("loadedFrom")).startswith("storage:")]
    assert len(storage) == 1, f"not one replica from storage after the drain: {rows}"
    parked = len(run.notes["parked"])
    return f"{struck(run)}: evicted {len(run.notes['evicted'])}, {parked} parked; {_loaded(run)}"


# ------------------------------------------------------------------------------ reboot


def rebooted(run: Run) -> None:
    node = node_of(run)
    with held_target(run):
        node.reboot(DOWN_SECONDS)


def verify_rebooted(run: Run) -> str:
    """No process and no container of before the reboot runs; the pods ran again."""
    survivors = run.notes["pids"] & run.worker_pids()
    assert not survivors, f"processes {sorted(survivors)} outlived the reboot"
    kept = run.notes["containers"] & _containers(run)
    assert not kept, f"containers {sorted(kept)} outlived the reboot"
    return f"{struck(run)}: {len(run.notes['pids'])} processes gone; {_loaded(run)}"


FAULTS: tuple[NodeFault, ...] = (
    NodeFault("oom-killed-while-loading", oom_while_loading, verify_oom),
    NodeFault(
        "kubelet-restart-mid-pull",
        daemon_restarted("kubelet"),
        verify_daemon_restarted,
        fast=True,  # the cheapest: nothing is recreated
    ),
    NodeFault(
        "containerd-restart-mid-pull", daemon_restarted("containerd"), verify_daemon_restarted
    ),
    NodeFault("drained-holding-the-only-source", drained, verify_drained),
    NodeFault("node-rebooted-mid-pull", rebooted, verify_rebooted),
)
