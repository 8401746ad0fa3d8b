"""`weightlift bench chaos`: fault scenarios against the real local stack, each ending in a check.

One LocalStack (control plane, process node, operator: local/stack.py) runs every scenario in turn.
A scenario applies a ModelDeployment, injects its fault (SIGKILL the operator, restart the
kube-apiserver, lose the node, corrupt a file, a hook library that crashes, faults while Targets
wait in Standby: bench/chaos_standby.py) and then waits for convergence: the right number of
replicas Ready with `observedGeneration` caught up and exactly those pods and worker processes,
or, for broken inputs, no replica Ready and a status that names what is wrong and where.
Meanwhile a watcher sends the probe request to every replica the status calls Ready and compares
the answer with the expected output of the right weights: a replica that answers otherwise counts
as wrong weights served. After each scenario the deployment is deleted and every worker process
started since the scenario began must be gone (orphans).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.api.labels import DEPLOYMENT_LABEL
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.bench import chaos_failover as failover
from weightlift.bench import chaos_standby as standby
from weightlift.local.kube import KUBE_ERRORS, Kube, call, describe, get_or_none
from weightlift.local.models import build_hook_library
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

JSON = dict[str, Any]
# Deadlines, not speed checks: a loaded 2-core CI box took 215 s for the operator scenario.
CONVERGE_TIMEOUT = 420.0
GONE_TIMEOUT = 120.0
# What ends a scenario unconverged (reported, not raised).
SCENARIO_ERRORS: tuple[type[Exception], ...] = (
    TimeoutError,
    RuntimeError,
    *KUBE_ERRORS,
    AssertionError,
)

SEGFAULT_HOOK = """
#include <stddef.h>
void* triton_pytorch_model_init(const char* model_dir, int device) {
    (void)model_dir; (void)device;
    volatile int* p = NULL;
    *p = 1;
    return NULL;
}
"""
HANGING_HOOK = """
#include <unistd.h>
void* triton_pytorch_model_init(const char* model_dir, int device) {
    (void)model_dir; (void)device;
    for (;;) pause();
    return 0;
}
"""


# ------------------------------------------------------------------------------ processes


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
    or Ready with a model identity in `banned`: a revision the spec has left). A scenario that
    changes the model sets `probe` to the new weights' probe."""

    def __init__(self, kubeconfig: Path, namespace: str, name: str, probe: JSON) -> None:
        super().__init__(name=f"weights-watch-{name}", daemon=True)
        self.kubeconfig, self.namespace, self.name, self.probe = kubeconfig, namespace, name, probe
        self.never_ready = False
        self.banned: set[str] = set()
        self.wrong: set[str] = set()
        self.checked: set[str] = set()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def run(self) -> None:
        kube = Kube(self.kubeconfig, "chaos-weights-watch")
        try:
            with httpx.Client(timeout=10.0) as http:
                while not self._halt.wait(0.3):
                    with contextlib.suppress(*KUBE_ERRORS, httpx.HTTPError, OSError, ValueError):
                        self._check(kube, http)
        finally:
            kube.close()

    def _check(self, kube: Kube, http: httpx.Client) -> None:
        get = kube.custom.get_namespaced_custom_object
        md = get_or_none(get, GROUP, VERSION, self.namespace, PLURAL, self.name)
        if md is None:
            return
        ports = _pod_ports(kube, self.namespace, self.name)
        probe = self.probe  # one expectation per pass: a scenario may swap it meanwhile
        for rs in (md.get("status") or {}).get("replicaStatuses") or []:
            if not rs.get("ready"):
                continue
            pod = rs["name"]
            if self.never_ready or rs.get("modelIdentity") in self.banned:
                self.wrong.add(pod)
                continue
            ip, port = rs.get("podIP"), ports.get(pod)
            if not ip or port is None:
                continue
            url = f"http://{ip}:{port}/v2/models/{self.name}/infer"
            try:
                r = http.post(url, json=probe["request"])
            except httpx.HTTPError:
                continue  # gone between the status read and the request: not a wrong answer
            self.checked.add(pod)
            if r.status_code == 200 and not outputs_match(r.json().get("outputs") or [], probe):
                self.wrong.add(pod)


def _pod_ports(kube: Kube, namespace: str, name: str) -> dict[str, int]:
    selector = f"{DEPLOYMENT_LABEL}={name}"
    pods = call(kube.core.list_namespaced_pod, namespace, label_selector=selector)["items"]
    out: dict[str, int] = {}
    for pod in pods:
        for c in pod["spec"].get("containers", []):
            for p in c.get("ports", []):
                out.setdefault(pod["metadata"]["name"], int(p["containerPort"]))
    return out


# -------------------------------------------------------------------------------- models


@dataclass
class Models:
    """The right model, a different one (for the swapped program) and broken copies."""

    work: Path
    # An existing demo model (`weightlift model make-demo`, with its init hook) or None: one is
    # made under `work`.
    good: Path | None = None
    probe: JSON = field(init=False)

    def __post_init__(self) -> None:
        if self.good is None:
            self.good = self.work / "good"
        if not (self.good / "probe.json").exists():
            make_demo_model(self.good, 8.0)
        self.probe = json.loads((self.good / "probe.json").read_text())

    @property
    def model(self) -> Path:
        assert self.good is not None
        return self.good

    def alt(self) -> tuple[Path, JSON]:
        """The good model's program, hook and tensor shapes with other weights (another seed),
        and its probe: a replica that serves one where the other belongs answers wrongly, while
        shapes alone never tell them apart (only the model identity and the probe do)."""
        out = self.work / "alt"
        header, data = _split(_weights(self.model))
        if not (out / "probe.json").exists():
            # A byte under the good size: make-demo rounds layers up, so this gives as many.
            make_demo_model(out, (len(data) - 1) / 1e6, seed=11)
        alt_header, _ = _split(_weights(out))
        shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
        alt_shapes = {k: v["shape"] for k, v in alt_header.items() if k != "__metadata__"}
        if shapes != alt_shapes:
            raise RuntimeError(f"{out}: tensor shapes differ from {self.model}'s")
        probe: JSON = json.loads((out / "probe.json").read_text())
        return out, probe

    def copy(self, name: str) -> Path:
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(self.model, out)
        return out

    def other(self) -> Path:
        """A demo model of other dimensions (its program expects other weight shapes)."""
        out = self.work / "other"
        if not (out / "probe.json").exists():
            make_demo_model(out, 64.0, hook=False, seed=7)
        return out


def _weights(model_dir: Path) -> Path:
    return model_dir / "model.safetensors"


def _split(path: Path) -> tuple[JSON, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path: Path, header: JSON, data: bytes) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def truncate(model_dir: Path) -> str:
    path = _weights(model_dir)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - 4096)
    return path.name


def lying_header_length(model_dir: Path) -> str:
    path = _weights(model_dir)
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) + 1024)
    path.write_bytes(bytes(raw))
    return path.name


def overlapping_offsets(model_dir: Path) -> str:
    path = _weights(model_dir)
    header, data = _split(path)
    names = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )
    first, second = header[names[0]], header[names[1]]
    begin, end = second["data_offsets"]
    shift = (first["data_offsets"][1] - first["data_offsets"][0]) // 2
    second["data_offsets"] = [begin - shift, end - shift]
    _join(path, header, data)
    return path.name


def nan_weights(model_dir: Path) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    path = _weights(model_dir)
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path), metadata={"weightlift": "demo", "rank": "0"})
    return "non-finite"


# ----------------------------------------------------------------------------- scenarios


@dataclass
class Result:
    scenario: str
    converged: bool
    seconds: float | None
    orphans: int
    wrong_weights: int
    detail: str


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

    def replicas(self) -> list[JSON]:
        md = self.stack.get_md(self.name) or {}
        rows: list[JSON] = (md.get("status") or {}).get("replicaStatuses") or []
        return rows

    def pod_phase_seen(self, phases: set[str], count: int = 1) -> bool:
        return sum(1 for r in self.replicas() if r.get("phase") in phases) >= count

    def worker_pid(self, role: str, phases: set[str]) -> int | None:
        for r in self.replicas():
            if r.get("role") == role and r.get("phase") in phases:
                pids = self.stack.node.pids().get(f"{self.stack.namespace}/{r['name']}")
                if pids:
                    return pids[0]
        return None

    # -- convergence
    def converged(self, replicas: int) -> bool:
        md = self.stack.get_md(self.name)
        if md is None:
            return replicas == 0 and not self._node_pods() and not self.stack.pods(self.name)
        status = md.get("status") or {}
        if status.get("observedGeneration") != md["metadata"].get("generation"):
            return False
        rows = status.get("replicaStatuses") or []
        pods = [p for p in self.stack.pods(self.name) if not p["metadata"].get("deletionTimestamp")]
        if replicas == 0:
            return not rows and not pods and not self._node_pods()
        return (
            status.get("phase") == "Ready"
            and int(status.get("readyReplicas") or 0) == replicas
            and len(rows) == replicas
            and all(r.get("ready") for r in rows)
            and len(pods) == replicas
            and len(self._node_pods()) == replicas
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


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Run], None]
    replicas: int = 1  # Ready at the end (0: deleted or refused)
    refuses: str | None = None  # broken input: the status must name this; never Ready
    fast: bool = False  # in `make test`'s subset
    # After convergence: checks what the scenario is about (AssertionError: not converged) and
    # returns a line for the detail column.
    verify: Callable[[Run], str] | None = None


def _operator_killed(run: Run) -> None:
    run.deploy(replicas=2)
    run.wait("a replica loading", lambda: run.pod_phase_seen({"InitHooks", "Loading", "Serving"}))
    run.stack.kill_operator()
    time.sleep(2.0)
    run.fault_at = time.monotonic()
    run.stack.restart_operator()


def _source_signalled(sig: signal.Signals, stopped_for: float) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        run.deploy(replicas=3)
        run.wait(
            "a target pulling",
            lambda: (
                # Targets start with their source (standby): they wait, or pull once it serves.
                run.pod_phase_seen({"Standby", "Loading"}, 1)
                and bool([r for r in run.replicas() if r.get("role") == "Target"])
                and run.worker_pid("Source", {"Ready", "Serving"}) is not None
            ),
        )
        pid = run.worker_pid("Source", {"Ready", "Serving"})
        assert pid is not None
        run.fault_at = time.monotonic()
        import os

        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            time.sleep(stopped_for)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    return inject


def _apiserver_restarted(run: Run) -> None:
    run.deploy(replicas=3)
    run.wait("replicas loading", lambda: run.pod_phase_seen({"InitHooks", "Loading"}))
    run.fault_at = time.monotonic()
    run.stack.restart_apiserver(down_seconds=3.0)


def _deleted_mid_load(run: Run) -> None:
    run.deploy(replicas=3)
    run.wait("replicas loading", lambda: run.pod_phase_seen({"InitHooks", "Loading"}))
    run.fault_at = time.monotonic()
    run.stack.delete_md(run.name)


def _scale_flap(run: Run) -> None:
    run.deploy(replicas=3)
    run.wait("a replica loading", lambda: run.pod_phase_seen({"InitHooks", "Loading", "Serving"}))
    run.fault_at = time.monotonic()
    run.scale(0)
    time.sleep(1.5)
    run.scale(3)


def _revision_twice(run: Run) -> None:
    run.deploy(replicas=2)
    run.wait("Ready", lambda: run.converged(2))
    run.fault_at = time.monotonic()
    run.patch({"model": {"revision": "2"}})
    time.sleep(1.0)
    run.patch({"model": {"revision": "3"}})


def _node_lost(run: Run) -> None:
    run.deploy(replicas=2)
    run.wait("a replica loading", lambda: run.pod_phase_seen({"InitHooks", "Loading", "Serving"}))
    run.fault_at = time.monotonic()
    run.stack.replace_node(down_seconds=3.0)


def _hook(source: str, lib: str) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        model = run.models.copy(run.name)
        build_hook_library(model / "hooks" / lib, source)
        run.fault_at = time.monotonic()
        run.deploy(model, replicas=1, hook_library=f"hooks/{lib}", load_timeout_seconds=30)

    return inject


def _corrupt(corrupt: Callable[[Path], str]) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        model = run.models.copy(run.name)
        corrupt(model)
        run.fault_at = time.monotonic()
        run.deploy(model, replicas=1)

    return inject


def _swapped_program(run: Run) -> None:
    model = run.models.copy(run.name)
    shutil.copy(run.models.other() / "model.pt2", model / "model.pt2")
    run.fault_at = time.monotonic()
    run.deploy(model, replicas=1)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("operator-sigkill-mid-rollout", _operator_killed, replicas=2, fast=True),
    Scenario("source-sigkill-while-pulling", _source_signalled(signal.SIGKILL, 0), replicas=3),
    Scenario("source-sigstop-while-pulling", _source_signalled(signal.SIGSTOP, 20), replicas=3),
    Scenario("apiserver-restart-while-loading", _apiserver_restarted, replicas=3),
    Scenario("deleted-mid-load", _deleted_mid_load, replicas=0, fast=True),
    Scenario("scale-3-0-3", _scale_flap, replicas=3),
    Scenario("revision-changed-twice", _revision_twice, replicas=2),
    Scenario("node-lost-and-back", _node_lost, replicas=2),
    Scenario("hook-segfaults", _hook(SEGFAULT_HOOK, "libsegv.so"), 0, "libsegv.so"),
    Scenario("hook-hangs", _hook(HANGING_HOOK, "libhang.so"), 0, "libhang.so"),
    Scenario("truncated-safetensors", _corrupt(truncate), 0, "model.safetensors", fast=True),
    Scenario("header-length-lying", _corrupt(lying_header_length), 0, "model.safetensors"),
    Scenario("overlapping-offsets", _corrupt(overlapping_offsets), 0, "model.safetensors"),
    Scenario("nan-weights", _corrupt(nan_weights), 0, "non-finite"),
    Scenario("swapped-model-pt2", _swapped_program, 0, "model.pt2"),
    # Faults while Targets wait in Standby (the source is stalled until one is seen there).
    Scenario(
        "standby-source-sigkill",
        standby.source_dies,
        replicas=3,
        fast=True,  # about 10 s here: `make test` sees a fault strike a deployment in standby
        verify=standby.verify_source_dies,
    ),
    Scenario(
        "standby-revision-changed",
        standby.revision_changes,
        replicas=2,
        verify=standby.verify_revision_changes,
    ),
    Scenario(
        "standby-wait-for-source-expires",
        standby.wait_expires,
        replicas=2,
        verify=standby.verify_wait_expires,
    ),
    Scenario(
        "standby-scale-down",
        standby.scale_down_in_standby,
        replicas=2,
        verify=standby.verify_scale_down,
    ),
    Scenario(
        "standby-foreign-peer-refused",
        standby.foreign_peer,
        replicas=2,
        verify=standby.verify_foreign_peer,
    ),
    # Two operators with leader election; the active one dies mid-rollout: the takeover time.
    Scenario(
        "leader-sigkill-standby-takes-over",
        failover.leader_killed,
        replicas=3,
        verify=failover.verify_leader_killed,
    ),
)


def run_scenario(stack: LocalStack, models: Models, scenario: Scenario, index: int) -> Result:
    import os

    name = f"chaos{index}"
    before = worker_processes(os.getpid())
    watch = WeightsWatch(stack.kubeconfig, stack.namespace, name, models.probe)
    watch.never_ready = scenario.refuses is not None
    run = Run(stack, models, name, watch)
    watch.start()
    converged, seconds, detail = False, None, ""
    try:
        scenario.inject(run)
        what = scenario.refuses
        if what is not None:
            run.wait(f"status naming {what!r}", lambda: run.refused(what))
        else:
            run.wait(f"{scenario.replicas} Ready", lambda: run.converged(scenario.replicas))
        seconds = round(time.monotonic() - run.fault_at, 1)
        detail = run.status_text() if scenario.refuses else ""
        if scenario.verify is not None:
            detail = scenario.verify(run)
        converged = True
    except SCENARIO_ERRORS as exc:
        detail = f"{describe(exc)} [{run.status_text()}]"
    finally:
        watch.stop()
    orphans, left = _clean_up(run, before)
    if orphans:
        detail += f" [cleanup: {left}]"
    return Result(scenario.name, converged, seconds, orphans, len(watch.wrong), detail.strip())


def _clean_up(run: Run, before: set[int]) -> tuple[int, str]:
    """Delete the deployment; count what is left after the deadline: pods, node runners and
    worker processes started during the scenario."""
    import os

    names = [run.name, *run.others]
    for name in names:
        with contextlib.suppress(*KUBE_ERRORS):
            if run.stack.get_md(name) is not None:
                run.stack.delete_md(name)
    deadline = time.monotonic() + GONE_TIMEOUT
    left: set[int] = set()
    while time.monotonic() < deadline:
        left = worker_processes(os.getpid()) - before
        pods = [p for n in names for p in run.stack.pods(n)]
        mds = [n for n in names if run.stack.get_md(n) is not None]
        if not left and not pods and not run._node_pods(*names) and not mds:
            return 0, "gone"
        time.sleep(0.5)
    pods = [p for n in names for p in run.stack.pods(n)]
    return len(left) + len(pods), f"left {len(left)} processes, {len(pods)} pods"


def scenario(name: str) -> tuple[int, Scenario]:
    """Its index (it names the deployment: chaos<index>) and the scenario."""
    for i, s in enumerate(SCENARIOS):
        if s.name == name:
            return i, s
    raise KeyError(name)


def run_all(stack: LocalStack, models: Models, scenarios: list[Scenario]) -> list[Result]:
    results = []
    for s in scenarios:
        results.append(run_scenario(stack, models, s, scenario(s.name)[0]))
        click.echo(_row(results[-1]), err=True)
    return results


def _row(r: Result) -> str:
    secs = f"{r.seconds:.1f}" if r.seconds is not None else "-"
    return (
        f"{r.scenario:34} {'yes' if r.converged else 'NO':9} {secs:>8} {r.orphans:>7} "
        f"{r.wrong_weights:>13}  {r.detail[:90]}"
    )


def render(results: list[Result]) -> str:
    head = (
        f"{'scenario':34} {'converged':9} {'seconds':>8} {'orphans':>7} "
        f"{'wrong-weights':>13}  detail"
    )
    lines = [head, "-" * len(head)] + [_row(r) for r in results]
    ok = sum(r.converged for r in results)
    lines.append(
        f"{ok}/{len(results)} converged, {sum(r.orphans for r in results)} orphans, "
        f"{sum(r.wrong_weights for r in results)} replicas served wrong weights"
    )
    return "\n".join(lines)


@click.command("chaos")
@click.option("--scenario", "only", multiple=True, help="Run only these (repeatable).")
@click.option("--fast", is_flag=True, help="Only the small subset `make test` runs.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/chaos"),
    show_default=True,
)
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
def chaos_command(
    only: tuple[str, ...], fast: bool, json_out: Path | None, state_dir: Path, list_only: bool
) -> None:
    """Fault scenarios on the real local stack: converged?, seconds, orphans, wrong weights."""
    if list_only:
        for s in SCENARIOS:
            click.echo(s.name)
        return
    picked = [s for s in SCENARIOS if (not only or s.name in only) and (not fast or s.fast)]
    unknown = set(only) - {s.name for s in SCENARIOS}
    if unknown:
        raise click.BadParameter(f"unknown scenarios {sorted(unknown)}", param_hint="--scenario")
    state_dir = state_dir.resolve()
    models = Models(state_dir / "models")
    stack = LocalStack(
        state_dir / "stack",
        node_name="chaos-node",
        model_path_prefixes=(str(models.work),),
        worker_env={"CUDA_VISIBLE_DEVICES": ""},
    )
    with stack:
        results = run_all(stack, models, picked)
    click.echo(render(results))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if not all(r.converged and not r.orphans and not r.wrong_weights for r in results):
        raise SystemExit(1)
