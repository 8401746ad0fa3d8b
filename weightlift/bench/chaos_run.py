"""What every `weightlift bench chaos` scenario runs on: `Run` (one scenario's deployment, its
waits and its convergence check), the wrong-weights watcher and the count of worker processes.
The scenario modules (chaos.py, chaos_pull.py, chaos_standby.py, chaos_spares.py) import this
one, never each other's runner."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kubernetes import watch

from weightlift.api.labels import DEPLOYMENT_LABEL
from weightlift.api.model import GROUP, PLURAL, VERSION, CompletionProbe
from weightlift.bench.chaos_models import Models
from weightlift.local.kube import KUBE_ERRORS, Kube, call, get_or_none
from weightlift.local.observe import complete
from weightlift.local.stack import LocalStack, model_deployment
from weightlift.operator.probes import check_text

JSON = dict[str, Any]


class ScenarioSkipped(Exception):
    """A scenario that cannot inject its fault here (e.g. it must mount a filesystem and may
    not): reported as skipped, with the reason, not as unconverged."""


# Deadlines, not speed checks: a loaded 2-core CI box took 215 s for the operator scenario.
CONVERGE_TIMEOUT = 420.0


def _ppids() -> dict[int, int]:
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (d / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                out[int(d.name)] = int(fields[1])
    return out


def started(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), None if it is gone or a zombie: a pid and
    its start name one process, whatever reuses the number later."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def worker_processes(root: int) -> set[int]:
    """Live `weightlift worker` processes below `root` (this process): other people's stacks on
    the same machine are not ours to count."""
    ppids = _ppids()
    found: set[int] = set()
    for pid in ppids:
        p, hops = pid, 0
        while p in ppids and p != root and hops < 64:
            p, hops = ppids[p], hops + 1
        if p != root:
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"worker" in argv and any(a.endswith(b"weightlift") for a in argv):
                found.add(pid)
    return found


# ---------------------------------------------------------------------------- wrong weights


def outputs_match(outputs: list[JSON], probe: JSON) -> bool:
    """The replica's answer equals the expected output of the right weights (within tolerance)."""
    by_name = {o.get("name"): o for o in outputs}
    for expected in probe["expectedOutputs"]:
        got = by_name.get(expected["name"])
        if got is None or list(got.get("shape", [])) != list(expected["shape"]):
            return False
        data = got.get("data") or []
        if len(data) != len(expected["data"]):
            return False
        for a, b in zip(data, expected["data"], strict=True):
            if not isinstance(a, int | float) or not math.isfinite(float(a)):
                return False
            if abs(float(a) - float(b)) > float(probe["tolerance"]):
                return False
    return True


class WeightsWatch(threading.Thread):
    """Infers through every replica the status calls Ready; remembers the pods that answered
    with anything but the right weights' output (or that were Ready at all, when `never_ready`,
    or Ready with a model identity in `banned`: a revision the spec has left; those two from
    every version of the status, watched, not sampled). A scenario that
    changes the model sets `probe` to the new weights' probe; one whose old replicas may keep
    serving through the rollout names their weights' probe in `probes`, by model identity."""

    def __init__(self, kubeconfig: Path, namespace: str, name: str, probe: JSON) -> None:
        super().__init__(name=f"weights-watch-{name}", daemon=True)
        self.kubeconfig, self.namespace, self.name, self.probe = kubeconfig, namespace, name, probe
        self.never_ready = False
        self.banned: set[str] = set()
        self.probes: dict[str, JSON] = {}  # model identity -> its weights' probe
        self.wrong: set[str] = set()
        self.checked: set[str] = set()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def run(self) -> None:
        rows = threading.Thread(target=self._watch_rows, name=f"{self.name}-rows", daemon=True)
        rows.start()
        kube = Kube(self.kubeconfig, "chaos-weights-watch")
        try:
            with httpx.Client(timeout=10.0) as http:
                while not self._halt.wait(0.3):
                    with contextlib.suppress(*KUBE_ERRORS, httpx.HTTPError, OSError, ValueError):
                        self._check(kube, http)
        finally:
            kube.close()
            rows.join(timeout=20)

    def _watch_rows(self) -> None:
        """What may never be Ready (`never_ready`, `banned`), in every version of the status the
        API server has, from a list+watch stream: a row Ready between two probes counts too."""
        kube = Kube(self.kubeconfig, "chaos-ready-watch")
        custom = kube.custom
        args = (GROUP, VERSION, self.namespace, PLURAL)
        where = {"field_selector": f"metadata.name={self.name}"}
        version = ""
        try:
            while not self._halt.is_set():
                with contextlib.suppress(*KUBE_ERRORS):
                    if not version:  # first, or after the watch broke (e.g. 410 Gone)
                        listing = call(custom.list_namespaced_custom_object, *args, **where)
                        for md in listing["items"]:
                            self._flag(md)
                        version = listing["metadata"]["resourceVersion"]
                    stream = watch.Watch().stream(
                        custom.list_namespaced_custom_object,
                        *args,
                        resource_version=version,
                        timeout_seconds=2,
                        _request_timeout=10,
                        **where,
                    )
                    for event in stream:
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        version = event["object"]["metadata"]["resourceVersion"]
                        self._flag(event["object"])
                        if self._halt.is_set():
                            break
                self._halt.wait(0.1)
        finally:
            kube.close()

    def _flag(self, md: JSON) -> None:
        for rs in (md.get("status") or {}).get("replicaStatuses") or []:
            if rs.get("ready") and (self.never_ready or rs.get("modelIdentity") in self.banned):
                self.wrong.add(str(rs["name"]))

    def _check(self, kube: Kube, http: httpx.Client) -> None:
        get = kube.custom.get_namespaced_custom_object
        md = get_or_none(get, GROUP, VERSION, self.namespace, PLURAL, self.name)
        if md is None:
            return
        ports = pod_ports(kube, self.namespace, self.name)
        default, probes = self.probe, dict(self.probes)  # a scenario may swap them meanwhile
        for rs in (md.get("status") or {}).get("replicaStatuses") or []:
            if not rs.get("ready"):
                continue
            pod = rs["name"]
            if self.never_ready or rs.get("modelIdentity") in self.banned:
                self.wrong.add(pod)
                continue
            probe = probes.get(str(rs.get("modelIdentity")), default)
            ip, port = rs.get("podIP"), ports.get(serving_pod(rs))
            if not ip or port is None:
                continue
            try:
                right = answers_right(http, f"http://{ip}:{port}", self.name, probe)
            except httpx.HTTPError:
                continue  # gone between the status read and the request: not a wrong answer
            self.checked.add(pod)
            if right is False:
                self.wrong.add(pod)


def serving_pod(row: JSON) -> str:
    """The pod that answers inference for a replica status row: the replica's pod, or a
    group's leader (its row is named as the group and lists the pods, the leader first)."""
    pods = row.get("pods") or []
    return str(pods[0]["name"]) if pods else str(row["name"])


def answers_right(http: httpx.Client, base: str, model: str, probe: JSON) -> bool | None:
    """Whether the replica at `base` answers `probe` as the right weights do (None: a non-200
    answer; httpx.HTTPError: none). A KServe v2 probe's request against its expected outputs;
    an LLM's completion probe (vLLM) as greedy text through the worker's OpenAI /v1, against
    the text transformers computed for it (local/llm.py)."""
    if "request" not in probe:
        completion = probe["completion"]
        text = complete(f"{base}/v1", model, completion, timeout=120.0)
        return check_text(text, CompletionProbe.model_validate(completion)) is None
    r = http.post(f"{base}/v2/models/{model}/infer", json=probe["request"])
    if r.status_code != 200:
        return None
    return outputs_match(r.json().get("outputs") or [], probe)


def pod_ports(kube: Kube, namespace: str, name: str) -> dict[str, int]:
    selector = f"{DEPLOYMENT_LABEL}={name}"
    pods = call(kube.core.list_namespaced_pod, namespace, label_selector=selector)["items"]
    out: dict[str, int] = {}
    for pod in pods:
        for c in pod["spec"].get("containers", []):
            for p in c.get("ports", []):
                out.setdefault(pod["metadata"]["name"], int(p["containerPort"]))
    return out


# ------------------------------------------------------------------------------- the run


class Run:
    """One scenario's deployment and its checks."""

    def __init__(
        self, stack: LocalStack, models: Models, name: str, watch: WeightsWatch | None = None
    ) -> None:
        self.stack, self.models, self.name, self.watch = stack, models, name, watch
        self.fault_at = time.monotonic()
        # Other ModelDeployments the scenario applied: deleted with it, their processes counted.
        self.others: list[str] = []
        self.notes: JSON = {}  # what the scenario saw, for its `verify`
        # Run when the scenario ends, converged or not (a watch thread it started, stopped).
        self.cleanups: list[Callable[[], None]] = []
        # Every process of its pods `worker_pids` saw, with its start: the orphan count's, on
        # a real node too (its containers' processes are not this process's descendants).
        self.seen: dict[int, str] = {}

    def deploy(self, model_dir: Path | None = None, replicas: int = 1, **kw: Any) -> None:
        manifest = model_deployment(
            kw.pop("name", self.name),
            model_dir or self.models.model,
            replicas=replicas,
            probe=kw.pop("probe", self.models.probe),
            probe_period_seconds=1,
            wait_for_source_seconds=kw.pop("wait_for_source_seconds", 120),
            **kw,
        )
        self.stack.apply(manifest)

    def patch(self, spec: JSON) -> None:
        self.stack.patch_md(self.name, {"spec": spec})

    def scale(self, replicas: int) -> None:
        self.stack.scale_md(self.name, replicas)

    def wait(self, what: str, pred: Callable[[], bool], timeout: float = CONVERGE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.stack.check_operator()
            with contextlib.suppress(*KUBE_ERRORS, httpx.HTTPError):
                if pred():
                    return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: {what} not within {timeout:.0f}s")

    def planned(self) -> bool:
        """The operator has acted on the spec as it is now (its status' observedGeneration)."""
        md = self.stack.get_md(self.name) or {}
        generation = md.get("metadata", {}).get("generation")
        observed = (md.get("status") or {}).get("observedGeneration")
        return generation is not None and observed == generation

    def replicas(self) -> list[JSON]:
        md = self.stack.get_md(self.name) or {}
        rows: list[JSON] = (md.get("status") or {}).get("replicaStatuses") or []
        return rows

    def row(self, pod: str) -> JSON:
        return next((r for r in self.replicas() if r["name"] == pod), {})

    def pod_uids(self) -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.stack.pods(self.name)}

    def pod_log(self, pod: str, uid: str | None = None) -> str:
        """What `pod`'s containers wrote on the node, every run of them: the pod of that uid
        (the live one by default); an earlier scenario's pod of the same name is another."""
        uid = uid or self.pod_uids().get(pod, "")
        assert uid, f"{pod}: no such pod"
        logs = self.stack.node.pod_logs(self.stack.namespace, pod)
        mine = [
            p for p in logs if uid[:8] in p.parent.name
        ] or logs  # process node: <ns>_<pod>_<uid8>
        return "\n".join(p.read_text(errors="replace") for p in mine)

    @property
    def gate(self) -> Path:
        """The node's fault gate, either kind: holds on its workers' pulls and steps
        (worker/p2p/faultgate.py)."""
        return self.stack.node.fault_gate_dir

    def worker_pids(self) -> set[int]:
        """The processes of this deployment's pods on the node now."""
        pids = self.stack.node.pids()
        found = {pid for key in self._node_pods() for pid in pids.get(key, [])}
        for pid in found:
            when = started(pid)
            if when is not None:
                self.seen.setdefault(pid, when)
        return found

    def live_seen(self) -> set[int]:
        """The processes `worker_pids` saw that still run."""
        return {pid for pid, when in self.seen.items() if started(pid) == when}

    # -- convergence
    def converged(self, replicas: int, spares: int = 0, pods_per_replica: int = 1) -> bool:
        """`replicas` Ready and `spares` warm spares (spec.warmSpares: phase Spare, never
        Ready), and exactly their pods and worker processes (`pods_per_replica` each: a
        replica of several pods is a group, one status row)."""
        md = self.stack.get_md(self.name)
        if md is None:
            return replicas == 0 and not self._node_pods() and not self.stack.pods(self.name)
        status = md.get("status") or {}
        if status.get("observedGeneration") != md["metadata"].get("generation"):
            return False
        rows = status.get("replicaStatuses") or []
        pods = [p for p in self.stack.pods(self.name) if not p["metadata"].get("deletionTimestamp")]
        if replicas == 0 and spares == 0:
            return not rows and not pods and not self._node_pods()
        serving = [r for r in rows if not r.get("spare")]
        waiting = [r for r in rows if r.get("spare")]
        return (
            status.get("phase") == "Ready"
            and int(status.get("readyReplicas") or 0) == replicas
            and len(serving) == replicas
            and all(r.get("ready") for r in serving)
            and int(status.get("spares") or 0) == spares
            and len(waiting) == spares
            and all(r.get("phase") == "Spare" and not r.get("ready") for r in waiting)
            and len(pods) == (replicas + spares) * pods_per_replica
            and len(self._node_pods()) == (replicas + spares) * pods_per_replica
        )

    def refused(self, what: str) -> bool:
        """Not Ready, and the status names `what` (the file or library and what is wrong)."""
        md = self.stack.get_md(self.name) or {}
        status = md.get("status") or {}
        rows = status.get("replicaStatuses") or []
        if any(r.get("ready") for r in rows):
            return False
        texts = [status.get("message") or ""] + [r.get("message") or "" for r in rows]
        return any(what in t for t in texts)

    def status_text(self) -> str:
        md = self.stack.get_md(self.name) or {}
        status = md.get("status") or {}
        msgs = [str(status.get("message") or "")]
        msgs += [f"{r['name']}: {r.get('message')}" for r in status.get("replicaStatuses") or []]
        return " | ".join(m for m in msgs if m)[:400]

    def _node_pods(self, *names: str) -> list[str]:
        """The node's pods of this deployment (or of `names`)."""
        prefixes = tuple(f"{n}-" for n in names or (self.name,))
        return [k for k in self.stack.node.pids() if k.split("/")[1].startswith(prefixes)]
