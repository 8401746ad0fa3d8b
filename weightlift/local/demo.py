"""`weightlift demo`: the whole lifecycle on one machine, for real.

A real control plane (etcd, kube-apiserver, controller-manager, scheduler; see cluster.py), the
process node (processnode.py: worker pods run as local processes on 127.0.x.y), the operator
(`weightlift operator`, a subprocess), a demo model with an init hook (`weightlift model
make-demo`), and one ModelDeployment. The view follows each replica from Pending to Ready; the
summary (and `--json`) says where each replica's weights came from and how long it took.

`LocalStack` is the reusable part: the e2e tests use it too. Everything it starts it stops, on
success, on errors and on Ctrl-C/SIGTERM, and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import click
import httpx

from weightlift.api.labels import DEPLOYMENT_LABEL
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.kubeclient import JSON, MERGE, Kube, KubeError
from weightlift.local.processnode import LOCAL_NODE_LABEL, ProcessNode
from weightlift.local.procs import child_options, stop_group
from weightlift.local.storage import STORAGE_KINDS, DemoStorage, prepare_storage

log = logging.getLogger("weightlift.demo")

BIN_DIR = Path(sys.executable).parent
# vLLM's OpenAI server port in demo/e2e pods (each pod has its own 127.0.x.y).
VLLM_PORT = 8001
# vLLM settings that keep it small and quick on a laptop or a 2-core CI box.
VLLM_ENGINE_ARGS = [
    "--max-model-len",
    "256",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--distributed-executor-backend",
    "uni",
]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def weightlift_exe() -> str:
    exe = BIN_DIR / "weightlift"
    return str(exe) if exe.exists() else "weightlift"


def md_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


# ------------------------------------------------------------------------------ the stack


def apply_crd(kube: Kube, timeout: float = 30.0) -> None:
    """Create (or replace) the ModelDeployment CRD as `weightlift crd` renders it; wait until
    it is Established."""
    from weightlift.api.crd import build_crd

    crd = build_crd()
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    name = crd["metadata"]["name"]
    try:
        kube.create(path, crd)
    except KubeError as exc:
        if exc.status != 409:
            raise
        current = kube.get(f"{path}/{name}")
        crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        kube.replace(f"{path}/{name}", crd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = kube.get(f"{path}/{name}")
        conds = (obj.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
            return
        time.sleep(0.1)
    raise RuntimeError(f"CRD {name} not Established after {timeout:.0f}s")


@dataclass
class LocalStack:
    """Control plane + process node + operator, up in `__enter__`, all gone after `__exit__`.

    >>> with LocalStack(Path(".state/demo")) as stack:
    ...     stack.apply(manifest)
    """

    state_dir: Path
    namespace: str = "default"
    node_name: str = "local-0"
    gpus: int = 8
    operator_verbose: bool = False
    # Extra env for worker processes and the operator (tests set timeouts, etc.).
    worker_env: dict[str, str] = field(default_factory=dict)
    operator_env: dict[str, str] = field(default_factory=dict)
    # Directories hostpath:// model URIs may name (the operator's --model-path-prefix).
    model_path_prefixes: tuple[str, ...] = ()

    kube: Kube = field(init=False)
    node: ProcessNode = field(init=False)
    kubeconfig: Path = field(init=False)
    _cluster: Any = field(init=False, default=None)
    _operator: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _node_started: bool = field(init=False, default=False)

    def __enter__(self) -> LocalStack:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    # -- up
    def up(self, progress: Callable[[str], None] = lambda _msg: None) -> None:
        from weightlift.local.cluster import ControlPlane, GpuNodeSpec

        self.state_dir = Path(self.state_dir).resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        progress("starting control plane (etcd, kube-apiserver, controller-manager, scheduler)")
        # No kwok GPU nodes: every worker pod must land on the process node and really run.
        # Bound to this process: a killed test run or demo leaves no control plane behind.
        self._cluster = ControlPlane(
            self.state_dir / "cluster", nodes=GpuNodeSpec(count=0), bind_to_parent=True
        )
        info = self._cluster.up()
        self.kubeconfig = Path(info.kubeconfig)
        self.kube = Kube(self.kubeconfig)
        progress("applying the ModelDeployment CRD")
        apply_crd(self.kube)
        progress(f"starting process node {self.node_name}")
        self.node = ProcessNode(
            self.kubeconfig,
            self.node_name,
            self.state_dir / "node",
            gpus=self.gpus,
            extra_env=dict(self.worker_env),
        )
        self.node.start()
        self._node_started = True
        progress("starting operator")
        self._start_operator()

    def _start_operator(self) -> None:
        log_path = self.state_dir / "operator.log"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            **self.operator_env,
        }
        argv = [weightlift_exe(), "operator", "--namespace", self.namespace]
        for prefix in self.model_path_prefixes:
            argv += ["--model-path-prefix", str(Path(prefix).resolve())]
        if self.operator_verbose:
            argv.append("--verbose")
        with log_path.open("ab") as out:
            self._operator = subprocess.Popen(
                argv, **child_options(out, env=env, die_with=signal.SIGTERM)
            )

    # -- faults (the chaos bench): each leaves the stack whole again, or says why not
    @property
    def operator_pid(self) -> int | None:
        return self._operator.pid if self._operator is not None else None

    def kill_operator(self) -> None:
        """SIGKILL the operator (no cleanup, no kopf shutdown): what a node crash does."""
        if self._operator is not None:
            stop_group(self._operator, grace=0.0, first=signal.SIGKILL)
            self._operator = None

    def restart_operator(self) -> None:
        if self._operator is not None:
            stop_group(self._operator, grace=15.0)
        self._start_operator()

    def restart_apiserver(self, down_seconds: float = 2.0) -> None:
        self._cluster.restart("kube-apiserver", down_seconds=down_seconds)

    def replace_node(self, down_seconds: float = 2.0) -> None:
        """Lose the process node (every worker process killed, its Node deleted), then bring a
        fresh one up under the same name, as a rebooted machine rejoins."""
        if self._node_started:
            self.node.stop(timeout=20.0)
            self._node_started = False
        time.sleep(down_seconds)
        self.node = ProcessNode(
            self.kubeconfig,
            self.node_name,
            self.state_dir / "node",
            gpus=self.gpus,
            extra_env=dict(self.worker_env),
        )
        self.node.start()
        self._node_started = True

    def operator_log_tail(self, lines: int = 40) -> str:
        try:
            text = (self.state_dir / "operator.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no operator log)"
        return "\n".join(text[-lines:])

    def check_operator(self) -> None:
        if self._operator is not None and self._operator.poll() is not None:
            raise RuntimeError(
                f"operator exited with {self._operator.returncode}:\n{self.operator_log_tail()}"
            )

    # -- down
    def down(self) -> None:
        """Operator first (so nothing is recreated), then every worker process, then the cluster."""
        if self._operator is not None:
            stop_group(self._operator, grace=15.0)
            self._operator = None
        if self._node_started:
            self.node.stop(timeout=20.0)
            self._node_started = False
        if self._cluster is not None:
            self._cluster.down()
            self._cluster = None
        with contextlib.suppress(AttributeError):
            self.kube.close()

    # -- helpers for the demo and tests
    def apply(self, manifest: JSON) -> JSON:
        ns = manifest["metadata"].get("namespace", self.namespace)
        name = manifest["metadata"]["name"]
        try:
            return self.kube.create(md_path(ns), manifest)
        except KubeError as exc:
            if exc.status != 409:
                raise
        return self.kube.patch(md_path(ns, name), {"spec": manifest["spec"]}, content_type=MERGE)

    def get_md(self, name: str) -> JSON | None:
        return self.kube.get_or_none(md_path(self.namespace, name))

    def pods(self, name: str) -> list[JSON]:
        listing = self.kube.get(
            f"/api/v1/namespaces/{self.namespace}/pods",
            {"labelSelector": f"{DEPLOYMENT_LABEL}={name}"},
        )
        items: list[JSON] = listing["items"]
        return items

    def delete_md(self, name: str) -> None:
        self.kube.delete(md_path(self.namespace, name))


# ------------------------------------------------------------------------------ the model


def make_demo_model(out: Path, size_mb: float, *, hook: bool = True, seed: int = 0) -> JSON:
    """Run `weightlift model make-demo` (torch stays out of this process); return probe.json."""
    argv = [
        weightlift_exe(),
        "model",
        "make-demo",
        "--out",
        str(out),
        "--size-mb",
        str(size_mb),
        "--seed",
        str(seed),
    ]
    if not hook:
        argv.append("--no-hook")
    res = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"make-demo failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    probe: JSON = json.loads((out / "probe.json").read_text())
    return probe


def model_deployment(
    name: str,
    model_dir: Path,
    *,
    replicas: int,
    probe: JSON | None,
    namespace: str = "default",
    revision: str = "1",
    hook_library: str | None = "hooks/libinit.so",
    strategy: str = "Auto",
    wait_for_source_seconds: int = 300,
    probe_period_seconds: int = 2,
    load_timeout_seconds: int = 600,
    model: JSON | None = None,
    engine: str = "Builtin",
    engine_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> JSON:
    """A ModelDeployment for a local demo model, pinned to process nodes. `model` overrides
    spec.model fields (another uri, endpoint, credentials: see local/storage.py). engine "vLLM":
    an HF model directory served by vLLM with weightlift loading (the init hook runs in each
    vLLM rank's process)."""
    vllm = engine == "vLLM"
    spec: JSON = {
        "model": {
            "uri": f"hostpath://{model_dir.resolve()}",
            "format": "safetensors" if vllm else "pt2",
            "revision": revision,
            "name": name,
            **(model or {}),
        },
        "replicas": replicas,
        "template": {
            "nodeSelector": {LOCAL_NODE_LABEL: "true"},
            "shmSize": "1Gi",
        },
        "loading": {
            "strategy": strategy,
            "initialSources": 1,
            "waitForSourceSeconds": wait_for_source_seconds,
            "loadTimeoutSeconds": load_timeout_seconds,
            "peerToPeer": {"transferTimeoutSeconds": 30},
        },
    }
    if vllm:
        spec["runtime"] = {
            "engine": engine,
            "enginePort": VLLM_PORT,
            "engineArgs": engine_args or [],
        }
    if env:
        spec["template"]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if hook_library:
        spec["initHooks"] = {"library": hook_library, "required": True}
    if probe is not None:
        keep = ("request", "expectedOutputs", "tolerance", "completion")
        spec["probe"] = {
            **{k: v for k, v in probe.items() if k in keep},
            "periodSeconds": probe_period_seconds,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# --------------------------------------------------------------------------- observation


@dataclass
class ReplicaTimes:
    """What the demo saw of one pod, on the wall clock (the worker's timeline uses it too)."""

    first_seen: float
    scheduled_at: float | None = None
    ready_at: float | None = None


@dataclass
class Observer:
    """Polls a ModelDeployment and its pods; remembers when each pod appeared and got Ready."""

    stack: LocalStack
    name: str
    started: float = field(default_factory=time.monotonic)
    times: dict[str, ReplicaTimes] = field(default_factory=dict)
    md: JSON | None = None
    pods: list[JSON] = field(default_factory=list)
    ready_at: float | None = None

    def poll(self) -> JSON | None:
        now = time.monotonic()
        wall = time.time()
        self.md = self.stack.get_md(self.name)
        self.pods = self.stack.pods(self.name)
        for pod in self.pods:
            pod_name = pod["metadata"]["name"]
            seen = self.times.setdefault(pod_name, ReplicaTimes(first_seen=wall))
            if seen.scheduled_at is None and (pod.get("spec") or {}).get("nodeName"):
                seen.scheduled_at = wall
        for rs in self.replica_statuses():
            t = self.times.get(rs["name"])
            if t is not None and rs.get("ready") and t.ready_at is None:
                t.ready_at = wall
        if self.phase() == "Ready" and self.ready_at is None:
            self.ready_at = now
        return self.md

    def status(self) -> JSON:
        status: JSON = (self.md or {}).get("status", {}) or {}
        return status

    def phase(self) -> str:
        return str(self.status().get("phase", "Pending"))

    def replica_statuses(self) -> list[JSON]:
        rows: list[JSON] = self.status().get("replicaStatuses", []) or []
        return sorted(rows, key=lambda r: (r.get("replica", 0), r.get("name", "")))

    def condition(self, ctype: str) -> JSON | None:
        for c in self.status().get("conditions", []) or []:
            if c.get("type") == ctype:
                cond: JSON = c
                return cond
        return None

    def wait(
        self,
        predicate: Callable[[Observer], bool],
        timeout: float,
        what: str,
        tick: Callable[[Observer], None] | None = None,
        interval: float = 0.25,
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.stack.check_operator()
            self.poll()
            if tick is not None:
                tick(self)
            if predicate(self):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {timeout:.0f}s waiting for {what}; phase={self.phase()} "
                    f"message={self.status().get('message', '')!r}\n"
                    + "\n".join(
                        f"  {r.get('name')}: {r.get('role')} {r.get('phase')} "
                        f"ready={r.get('ready')} {r.get('message', '')}"
                        for r in self.replica_statuses()
                    )
                )
            time.sleep(interval)

    def wait_ready(self, timeout: float, tick: Callable[[Observer], None] | None = None) -> None:
        def ready(o: Observer) -> bool:
            desired = int(((o.md or {}).get("spec") or {}).get("replicas", 0))
            return (
                o.phase() == "Ready"
                and int(o.status().get("readyReplicas", 0)) >= desired
                and sum(1 for r in o.replica_statuses() if r.get("ready")) >= desired
            )

        self.wait(ready, timeout, f"{self.name} Ready", tick=tick)

    def summary(self) -> JSON:
        """The `--json` document."""
        pods_by_name = {p["metadata"]["name"]: p for p in self.pods}
        runtime = ((self.md or {}).get("spec") or {}).get("runtime") or {}
        engine_port = runtime.get("enginePort") if runtime.get("engine") == "vLLM" else None
        replicas = []
        for rs in self.replica_statuses():
            pod = pods_by_name.get(rs["name"], {})
            port = _container_port(pod)
            ip = rs.get("podIP") or (pod.get("status") or {}).get("podIP")
            t = self.times.get(rs["name"])
            replicas.append(
                {
                    "name": rs["name"],
                    "role": rs.get("role"),
                    "loadedFrom": rs.get("loadedFrom"),
                    "endpoint": f"http://{ip}:{port}" if ip else None,
                    "model": self.name,
                    **(
                        {
                            "openaiEndpoint": f"http://{ip}:{engine_port}/v1" if ip else None,
                            "servedModelName": self.name,
                        }
                        if engine_port
                        else {}
                    ),
                    "hooksRun": rs.get("hooksRun"),
                    "loadSeconds": rs.get("loadSeconds"),
                    "gbps": rs.get("gbps"),
                    "bytesTotal": rs.get("bytesTotal"),
                    "ready": rs.get("ready"),
                    "secondsToReady": round(t.ready_at - t.first_seen, 3)
                    if t is not None and t.ready_at is not None
                    else None,
                    "timeline": replica_timeline(t, _worker_timeline(ip, port))
                    if t is not None and ip
                    else {},
                }
            )
        return {
            "phase": self.phase(),
            "secondsToReady": round(self.ready_at - self.started, 3)
            if self.ready_at is not None
            else None,
            "replicas": replicas,
        }


# Where a replica's seconds went, in order: each step ends at the named mark. Marks from the
# demo's own polling (0.25 s resolution): created, scheduled, ready; from the worker's report:
# the rest (its process start, HTTP up, model fetched, hooks run, weights loaded, bound, serving).
# vLLM replicas: "engine" (vLLM started and initialized up to its weight load; it then runs the
# hooks and loads inside each rank) and "processed" (vLLM's load_weights and post-processing)
# instead of "bind"; steps a replica lacks are left out.
TIMELINE_STEPS = (
    ("scheduling", "scheduled"),
    ("process start", "process"),
    ("imports + server", "server"),
    ("fetch", "fetch"),
    ("engine start", "engine"),
    ("hooks", "hooks"),
    ("load", "load"),
    ("bind", "bind"),
    ("vLLM processing", "processed"),
    ("serve", "serving"),
    ("probe", "ready"),
)


def replica_timeline(seen: ReplicaTimes, worker: dict[str, float]) -> dict[str, float]:
    """Seconds per step (TIMELINE_STEPS) for one replica; steps without both marks are left out."""
    marks: dict[str, float | None] = {
        "created": seen.first_seen,
        "scheduled": seen.scheduled_at,
        **worker,
        "ready": seen.ready_at,
    }
    out: dict[str, float] = {}
    prev = marks["created"]
    for step, mark in TIMELINE_STEPS:
        at = marks.get(mark)
        if at is None or prev is None:
            continue
        out[step] = round(max(0.0, at - prev), 3)
        prev = at
    return out


def _worker_timeline(ip: str, port: int) -> dict[str, float]:
    try:
        r = httpx.get(f"http://{ip}:{port}/weightlift/v1/status", timeout=5.0)
        timeline = r.json().get("timeline") or {}
    except (httpx.HTTPError, ValueError):
        return {}
    return {str(k): float(v) for k, v in timeline.items()}


def _container_port(pod: JSON) -> int:
    for c in (pod.get("spec") or {}).get("containers", []):
        for p in c.get("ports", []):
            return int(p["containerPort"])
    return 8000


def infer(endpoint: str, model: str, request: JSON, timeout: float = 10.0) -> JSON:
    r = httpx.post(f"{endpoint}/v2/models/{model}/infer", json=request, timeout=timeout)
    r.raise_for_status()
    body: JSON = r.json()
    return body


def complete(openai_base: str, model: str, completion: JSON, timeout: float = 60.0) -> str:
    """Greedy text of a completion probe's prompt, from an OpenAI /v1 endpoint."""
    body = {
        "model": model,
        "prompt": completion["prompt"],
        "max_tokens": completion["maxTokens"],
        "temperature": 0,
    }
    r = httpx.post(f"{openai_base}/completions", json=body, timeout=timeout)
    r.raise_for_status()
    text: str = r.json()["choices"][0]["text"]
    return text


# ---------------------------------------------------------------------------------- view


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e6:.1f} MB"


def render(obs: Observer) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    st = obs.status()
    elapsed = time.monotonic() - obs.started
    head = Text.assemble(
        ("weightlift demo ", "bold"),
        (f"{obs.name}  ", "cyan"),
        (f"phase {obs.phase()}  ", "bold green" if obs.phase() == "Ready" else "bold yellow"),
        f"ready {st.get('ready', '0/0')}  sources {st.get('readySources', 0)}  "
        f"loaded {st.get('loaded', '0%')}  {elapsed:5.1f}s",
    )
    table = Table(expand=False)
    for col in ("replica", "role", "source", "phase", "loaded", "GB/s", "hooks", "probe"):
        table.add_column(col)
    pod_phase = {p["metadata"]["name"]: (p.get("status") or {}).get("phase", "") for p in obs.pods}
    rows = obs.replica_statuses()
    seen = {r["name"] for r in rows}
    for rs in rows:
        total, loaded = int(rs.get("bytesTotal") or 0), int(rs.get("bytesLoaded") or 0)
        pct = f" {100 * loaded / total:3.0f}%" if total else ""
        gbps = rs.get("gbps")
        probe = rs.get("probe") or {}
        table.add_row(
            rs["name"],
            str(rs.get("role", "")),
            str(rs.get("loadedFrom") or "-"),
            "Ready" if rs.get("ready") else str(rs.get("phase", "")),
            f"{_fmt_bytes(loaded)}/{_fmt_bytes(total)}{pct}",
            f"{gbps:.2f}" if isinstance(gbps, int | float) else "-",
            {True: "ran", False: "no", None: "-"}[rs.get("hooksRun")],
            ("pass" if probe.get("passed") else str(probe.get("message", ""))[:40])
            if probe
            else "-",
        )
    for name, phase in sorted(pod_phase.items()):
        if name not in seen:
            table.add_row(name, "", "", f"pod {phase}", "", "", "", "")
    return Group(head, table, Text(str(st.get("message", "")), style="dim"))


# ----------------------------------------------------------------------------------- CLI


class _Terminated(Exception):
    pass


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.command("demo")
@click.option("--replicas", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option("--model-size-mb", type=float, default=64.0, show_default=True)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the summary as JSON here.",
)
@click.option(
    "--linger",
    type=float,
    default=0.0,
    show_default=True,
    help="Keep everything running this many seconds after Ready.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/demo"),
    show_default=True,
)
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Give up when not Ready after this many seconds.",
)
@click.option("--name", default="demo", show_default=True, help="ModelDeployment name.")
@click.option(
    "--storage",
    type=click.Choice(STORAGE_KINDS),
    default="hostpath",
    show_default=True,
    help="Where the model lives: a node directory, a PVC bound to one, or MinIO on loopback.",
)
@click.option(
    "--runtime",
    type=click.Choice(["builtin", "vllm"]),
    default="builtin",
    show_default=True,
    help="builtin: a PT2 demo model on weightlift's server. vllm: a tiny Llama on vLLM's CPU "
    "build with weightlift loading (its environment is built once under $WL_CACHE).",
)
def demo_command(
    replicas: int,
    model_size_mb: float,
    json_out: Path | None,
    linger: float,
    state_dir: Path,
    timeout: float,
    name: str,
    storage: str,
    runtime: str,
) -> None:
    """Control plane, process node, operator, demo model, ModelDeployment: watch it get Ready."""
    from rich.console import Console
    from rich.live import Live

    # Not a terminal (CI, a pipe): rich would wrap at 80 columns; the tables need more.
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    state_dir = state_dir.resolve()
    model_dir = state_dir / ("llm" if runtime == "vllm" else "model")
    stack = LocalStack(state_dir, model_path_prefixes=(str(model_dir),))
    where: DemoStorage | None = None
    with _sigterm_raises():
        try:
            if runtime == "vllm":
                probe = _prepare_vllm(console, stack, model_dir)
            else:
                with console.status("making the demo model (PT2 + safetensors + init hook)"):
                    probe = make_demo_model(model_dir, model_size_mb)
            console.print(f"[green]✓[/] demo model in {model_dir}")
            with console.status("bringing up the local cluster") as status:
                stack.up(progress=lambda msg: status.update(msg))
            console.print(
                f"[green]✓[/] control plane, process node [bold]{stack.node_name}[/], operator up"
                f"  (KUBECONFIG={stack.kubeconfig})"
            )
            with console.status(f"putting the model in {storage} storage"):
                where = prepare_storage(
                    storage, stack.kube, stack.namespace, name, model_dir, state_dir
                )
            console.print(f"[green]✓[/] model at {where.model['uri']}")
            manifest = model_deployment(
                name,
                model_dir,
                replicas=replicas,
                probe=probe,
                model=where.model,
                engine="vLLM" if runtime == "vllm" else "Builtin",
                engine_args=VLLM_ENGINE_ARGS if runtime == "vllm" else None,
                env=VLLM_ENV if runtime == "vllm" else None,
            )
            obs = Observer(stack, name)
            stack.apply(manifest)
            with Live(render(obs), console=console, refresh_per_second=8) as live:
                obs.wait_ready(timeout, tick=lambda o: live.update(render(o)))
                live.update(render(obs))
            summary = {**obs.summary(), "storage": storage, "uri": where.model["uri"]}
            _print_summary(console, summary, probe, name)
            if json_out is not None:
                json_out.parent.mkdir(parents=True, exist_ok=True)
                json_out.write_text(json.dumps(summary, indent=2) + "\n")
                console.print(f"wrote {json_out}")
            if linger > 0:
                console.print(
                    f"lingering {linger:.0f}s: KUBECONFIG={stack.kubeconfig} kubectl get md; "
                    f"curl {summary['replicas'][0]['endpoint']}/v2/models/{name}"
                )
                end = time.monotonic() + linger
                while time.monotonic() < end:
                    stack.check_operator()
                    time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        except (KeyboardInterrupt, _Terminated):
            console.print("[yellow]interrupted; tearing down[/]")
            raise SystemExit(130) from None
        except (TimeoutError, RuntimeError, KubeError) as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            console.print(f"[dim]operator log tail:\n{stack.operator_log_tail(20)}[/]")
            raise SystemExit(1) from None
        finally:
            with console.status("tearing down (operator, worker processes, control plane)"):
                if where is not None:
                    where.close()
                stack.down()
            console.print("[green]✓[/] everything stopped")


def add_hook_library(model_dir: Path) -> Path:
    """The demo's recording init hook (gcc) in `model_dir`/hooks, as the PT2 demo model has."""
    from weightlift.local.models import build_hook_library

    lib = model_dir / "hooks" / "libinit.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        build_hook_library(lib)
    return lib


def _prepare_vllm(console: Any, stack: LocalStack, model_dir: Path) -> JSON:
    """The vLLM environment (built on first use) and the tiny Llama; returns its probe."""
    from weightlift.local.llm import ensure_vllm_env, make_in_engine_env, vllm_python

    python = vllm_python()
    if python is None:
        with console.status("building the vLLM environment (once; minutes, about 6 GB)"):
            python = ensure_vllm_env()
    else:  # re-point its editable weightlift at this checkout (fast when it already is)
        with console.status("checking the vLLM environment"):
            ensure_vllm_env()
    with console.status("making the tiny Llama (HF layout, random weights, local tokenizer)"):
        probe = make_in_engine_env(python, model_dir)
        add_hook_library(model_dir)
    stack.worker_env.update({"WEIGHTLIFT_VLLM_PYTHON": str(python)})
    return probe


def _print_summary(console: Any, summary: JSON, probe: JSON, name: str) -> None:
    from rich.table import Table

    table = Table(title=f"{name}: Ready in {summary['secondsToReady']:.1f}s")
    for col in (
        "replica",
        "role",
        "loaded from",
        "endpoint",
        "hooks",
        "load s",
        "GB/s",
        "ready after s",
    ):
        table.add_column(col)
    for r in summary["replicas"]:
        table.add_row(
            r["name"],
            str(r["role"]),
            str(r["loadedFrom"]),
            str(r["endpoint"]),
            "ran" if r["hooksRun"] else "no",
            f"{r['loadSeconds']:.2f}" if r["loadSeconds"] is not None else "-",
            f"{r['gbps']:.2f}" if r["gbps"] is not None else "-",
            f"{r['secondsToReady']:.1f}" if r["secondsToReady"] is not None else "-",
        )
    console.print(table)
    timeline = Table(title="where each replica's seconds went (s)")
    timeline.add_column("replica")
    for step, _ in TIMELINE_STEPS:
        timeline.add_column(step)
    timeline.add_column("total")
    for r in summary["replicas"]:
        steps = r.get("timeline") or {}
        timeline.add_row(
            r["name"],
            *(f"{steps[s]:.2f}" if s in steps else "-" for s, _ in TIMELINE_STEPS),
            f"{sum(steps.values()):.2f}",
        )
    console.print(timeline)
    # One more real request through each endpoint: same input, same output everywhere.
    outputs = set()
    if "completion" in probe:
        for r in summary["replicas"]:
            if r.get("openaiEndpoint"):
                with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
                    outputs.add(complete(r["openaiEndpoint"], name, probe["completion"]))
        if outputs:
            same = "the expected" if outputs == {probe["completion"]["expectedText"]} else "OTHER"
            console.print(
                f"greedy completion through {len(summary['replicas'])} OpenAI endpoints: "
                f"{same} text {sorted(outputs)!r}"
            )
        return
    for r in summary["replicas"]:
        if r["endpoint"]:
            with contextlib.suppress(httpx.HTTPError):
                out = infer(r["endpoint"], name, probe["request"])
                outputs.add(json.dumps(out.get("outputs", []), sort_keys=True))
    if outputs:
        same = "identical" if len(outputs) == 1 else f"{len(outputs)} DIFFERENT"
        console.print(f"inference through {len(summary['replicas'])} endpoints: {same} outputs")
