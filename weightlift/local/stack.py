"""The local stack as a library: a real control plane, the process node and the operator on one
machine (what `weightlift demo`, the e2e tests and the benchmarks share), plus the demo model and
its ModelDeployment.

A real control plane (etcd, kube-apiserver, controller-manager, scheduler; see cluster.py), the
process node (processnode/: worker pods run as local processes on 127.0.x.y) and the operator
(`weightlift operator`, a subprocess). Everything `LocalStack` starts it stops, on success, on
errors and on Ctrl-C/SIGTERM, and leaves no process behind.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from weightlift.api.labels import DEPLOYMENT_LABEL
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.api.worker import COMPILE_STORE_ENV
from weightlift.local.kube import JSON, MERGE, Kube, call, delete, get_or_none, install_crds
from weightlift.local.net import free_port
from weightlift.local.nodekind import NodeKind, NodeKindName
from weightlift.local.processnode import LOCAL_NODE_LABEL, ProcessNode
from weightlift.local.procs import UpDown, child_options, stop_group
from weightlift.local.release import HelmRelease
from weightlift.operator.settings import METRICS_HOST_ENV, METRICS_PORT_ENV, LeaderElection

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
VLLM_EAGER = "--enforce-eager"


def vllm_engine_args(eager: bool) -> list[str]:
    """VLLM_ENGINE_ARGS in vLLM's default compiled mode (torch.compile; its compile cache then
    travels from source to targets), or eager (no compile at all)."""
    args = [a for a in VLLM_ENGINE_ARGS if a != VLLM_EAGER]
    return [*args, VLLM_EAGER] if eager else args


def engine_image(engine: str) -> str:
    """The worker image `make images` builds for a runtime engine (hack/build-images.sh's tags):
    the CRD's default for Builtin, worker-vllm and worker-triton beside it."""
    from weightlift.api.model import DEFAULT_WORKER_IMAGE

    repository, _, tag = DEFAULT_WORKER_IMAGE.rpartition(":")
    suffix = {"Builtin": "", "vLLM": "-vllm", "Triton": "-triton"}[engine]
    return f"{repository}{suffix}:{tag}"


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

    install_crds(kube, [build_crd()], timeout)


@dataclass
class LocalStack(UpDown):
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
    # "process": the operator is a local process with the admin kubeconfig. "helm": the chart
    # is installed with the real helm binary and the operator runs as its pod (release.py).
    install: str = "process"
    # Extra kube-apiserver flags (e.g. an audit log).
    apiserver_args: tuple[str, ...] = ()
    # Container image -> a root filesystem of it (local/images.py): the process node runs
    # containers of these images chrooted there. `operator_image` names the chart's operator
    # image (default: the chart's own, which `make images` builds under the same name).
    image_roots: dict[str, Path] = field(default_factory=dict)
    operator_image: str = ""
    # The chart's workerBundle.image (spec.template.worker Injected; default: the chart's).
    bundle_image: str = ""
    # Which node runs the pods (nodekind.py): "process" (host processes) or "kubelet" (the
    # pinned kubelet, containerd and runc; `images` are pushed to its registry, default: the
    # worker image and, with install "helm", the operator image).
    node_kind: NodeKindName = "process"
    images: tuple[str, ...] | None = None
    # The worker image the kubelet node's registry gets by default (engine_image: the engine's).
    worker_image: str = ""
    # Extended resources the kubelet node's device plugin advertises beside `gpus` x
    # nvidia.com/gpu, e.g. {"nvidia.com/mig-1g.10gb": 2} (the process node ignores them).
    extra_resources: dict[str, int] = field(default_factory=dict)
    # Run the LeaderWorkerSet controller (`make lws`): multi-pod replicas need it.
    with_lws: bool = False

    kube: Kube = field(init=False)
    node: NodeKind = field(init=False)
    kubeconfig: Path = field(init=False)
    _cluster: Any = field(init=False, default=None)
    _operator: subprocess.Popen[bytes] | None = field(init=False, default=None)
    # Operators with leader election (`use_leader_election`): identity -> process. While they
    # run, `_operator` does not: one reconciles, the others stand by, as the chart's replicas.
    _elected: dict[str, subprocess.Popen[bytes]] = field(init=False, default_factory=dict)
    election: LeaderElection | None = field(init=False, default=None)
    _node_started: bool = field(init=False, default=False)
    # The operator process's /metrics port on loopback: chosen once, kept across restarts.
    _metrics_port: int | None = field(init=False, default=None)
    _net: Any = field(init=False, default=None)  # the kubelet node's NodeNetwork
    _cluster_info: Any = field(init=False, default=None)
    release: HelmRelease | None = field(init=False, default=None)
    _lws: Any = field(init=False, default=None)  # the LwsController

    # -- up
    def up(self, progress: Callable[[str], None] = lambda _msg: None) -> None:
        from weightlift.local.cluster import ControlPlane, GpuNodeSpec

        self.state_dir = Path(self.state_dir).resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        bind_address = "127.0.0.1"
        if self.node_kind == "kubelet":
            from weightlift.local.kubeletnode import allocate_network

            progress("allocating the node's network namespace")
            self._net = allocate_network(self.state_dir / "node")
            bind_address = self._net.host_ip  # where the node's pods reach the API server
        progress("starting control plane (etcd, kube-apiserver, controller-manager, scheduler)")
        # No kwok GPU nodes: every worker pod must land on the local node and really run.
        # Bound to this process: a killed test run or demo leaves no control plane behind.
        self._cluster = ControlPlane(
            self.state_dir / "cluster",
            nodes=GpuNodeSpec(count=0),
            bind_to_parent=True,
            apiserver_args=self.apiserver_args,
            bind_address=bind_address,
        )
        info = self._cluster.up()
        self._cluster_info = info
        self.kubeconfig = Path(info.kubeconfig)
        self.kube = Kube(self.kubeconfig, "stack")
        if self.install == "helm":  # the CRD comes from the chart
            progress(f"starting {self.node_kind} node {self.node_name}")
            self._start_node(info)
            self._start_lws(progress)
            progress("helm install helm/weightlift (the operator runs as the chart's pod)")
            self._install_release()
            return
        progress("applying the ModelDeployment CRD")
        apply_crd(self.kube)
        progress(f"starting {self.node_kind} node {self.node_name}")
        self._start_node(info)
        self._start_lws(progress)
        progress("starting operator")
        self._start_operator()

    def _start_lws(self, progress: Callable[[str], None]) -> None:
        if not self.with_lws:
            return
        from weightlift.local.lws import LwsController

        progress("starting the LeaderWorkerSet controller")
        self._lws = LwsController(self.kubeconfig, self.state_dir / "lws")
        self._lws.up()

    @property
    def compile_store(self) -> str:
        """The node's compile-cache store: this stack's own host directory (the chart's
        default, under /var/cache, is the real node's)."""
        return str((self.state_dir / "compile-store").resolve())

    def chart_values(self) -> JSON:
        """The chart values that give the operator pod what `_start_operator` gives the
        process: the watched namespace, path prefixes, log level and extra env."""
        return {
            "watchNamespaces": [self.namespace],
            "modelPathPrefixes": [str(Path(p).resolve()) for p in self.model_path_prefixes],
            "logLevel": "debug" if self.operator_verbose else "info",
            "extraEnv": [{"name": k, "value": v} for k, v in self.operator_env.items()],
            "compileStore": self.compile_store,
            # The process node runs workers as this host's user: no uid to hand the store to.
            "compileStoreNodePrep": {"enabled": self.node_kind == "kubelet"},
            **_image_values(self.operator_image),
            **({"workerBundle": _image_values(self.bundle_image)} if self.bundle_image else {}),
        }

    def _install_release(self) -> None:
        self.release = HelmRelease(self.kubeconfig, values=self.chart_values())
        self.release.install()

    def operator_info(self) -> JSON:
        """Who runs the operator: the demo's `--json` "operator"."""
        if self.release is None:
            return {"installedBy": "process", "pid": self.operator_pid}
        pod = self.release.operator_pod() or {"metadata": {}, "spec": {}}
        return {
            "installedBy": "helm",
            "release": self.release.name,
            "namespace": self.release.namespace,
            "pod": pod["metadata"].get("name"),
            "serviceAccount": pod["spec"].get("serviceAccountName"),
        }

    def _start_operator(self) -> None:
        if self._metrics_port is None:
            self._metrics_port = free_port()
        self._operator = self._spawn_operator([], self.state_dir / "operator.log")

    def _spawn_operator(
        self, extra: list[str], log_path: Path, metrics_port: int | None = None
    ) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            METRICS_HOST_ENV: "127.0.0.1",
            METRICS_PORT_ENV: str(self._metrics_port),
            COMPILE_STORE_ENV: self.compile_store,
            **self.operator_env,
        }
        if metrics_port is not None:  # a candidate of several on this host: its own port
            env[METRICS_PORT_ENV] = str(metrics_port)
        argv = [weightlift_exe(), "operator", "--namespace", self.namespace, *extra]
        for prefix in self.model_path_prefixes:
            argv += ["--model-path-prefix", str(Path(prefix).resolve())]
        if self.operator_verbose:
            argv.append("--verbose")
        with log_path.open("ab") as out:
            return subprocess.Popen(argv, **child_options(out, env=env, die_with=signal.SIGTERM))

    # -- leader election: several operators, one active (what the chart's replicas do)
    def use_leader_election(
        self,
        election: LeaderElection | None,
        identities: tuple[str, ...] = ("operator-0", "operator-1"),
    ) -> None:
        """Replace the operator(s): one candidate for `election`'s Lease per identity, or, with
        None, the one plain operator again. Those running are stopped gracefully first (a
        leader hands its Lease on)."""
        self._stop_operators()
        self.election = election
        if election is None:
            self._start_operator()
            return
        for identity in identities:
            self.start_candidate(identity)

    def start_candidate(self, identity: str) -> None:
        """One more operator with leader election (a standby unless the Lease is free)."""
        e = self.election
        assert e is not None, "use_leader_election first"
        extra = [
            "--leader-elect",
            f"--lease-name={e.lease_name}",
            f"--lease-namespace={e.namespace}",
            f"--lease-identity={identity}",
            f"--lease-duration={e.lease_duration}",
            f"--renew-deadline={e.renew_deadline}",
            f"--retry-period={e.retry_period}",
        ]
        self._elected[identity] = self._spawn_operator(
            extra, self.candidate_log(identity), metrics_port=free_port()
        )

    def candidate_log(self, identity: str) -> Path:
        return self.state_dir / f"operator-{identity}.log"

    def candidate_pids(self) -> dict[str, int]:
        return {identity: proc.pid for identity, proc in self._elected.items()}

    def kill_candidate(self, identity: str) -> None:
        """SIGKILL one elected operator (a node crash): its Lease runs out, nobody hands it on."""
        proc = self._elected.pop(identity)
        stop_group(proc, grace=0.0, first=signal.SIGKILL)

    def _stop_operators(self) -> None:
        if self._operator is not None:
            stop_group(self._operator, grace=15.0)
            self._operator = None
        for identity in list(self._elected):
            stop_group(self._elected.pop(identity), grace=15.0)

    def operator_metrics_url(self) -> str | None:
        """The operator's /metrics: the process's loopback port, or the chart's pod's address
        and metrics.port (None while no operator pod has an address)."""
        if self.release is None:
            port = self.operator_env.get(METRICS_PORT_ENV) or self._metrics_port
            return f"http://127.0.0.1:{port}/metrics" if port else None
        pod = self.release.operator_pod()
        ip = ((pod or {}).get("status") or {}).get("podIP")
        port = (self.release.values.get("metrics") or {}).get("port", 8081)
        return f"http://{ip}:{port}/metrics" if ip else None

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
        if self.election is not None:
            raise RuntimeError("operators run with leader election: kill or start candidates")
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
        self._start_node(self._cluster_info)

    @property
    def process_node(self) -> ProcessNode:
        """The node as a ProcessNode, for what only it offers (its pod runners, chroots)."""
        if not isinstance(self.node, ProcessNode):
            raise TypeError(f"stack runs a {self.node_kind} node, not a process node")
        return self.node

    def node_images(self) -> tuple[str, ...]:
        """What the kubelet node's registry gets: `images`, or `worker_image` (default: the
        CRD's) and, when the chart runs the operator, its image."""
        if self.images is not None:
            return self.images
        from weightlift.local.release import CHART

        worker = self.worker_image or engine_image("Builtin")
        if self.install != "helm":
            return (worker,)
        image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
        app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        operator = self.operator_image or f"{image['repository']}:{image['tag'] or app}"
        return (worker, operator)

    def _start_node(self, info: Any) -> None:
        if self.node_kind == "kubelet":
            from weightlift.local.kubeletnode import KubeletNode

            self.node = KubeletNode(
                info,
                self._net,
                self.node_name,
                self.state_dir / "node",
                gpus=self.gpus,
                extra_resources=dict(self.extra_resources),
                images=self.node_images(),
            )
        else:
            self.node = ProcessNode(
                self.kubeconfig,
                self.node_name,
                self.state_dir / "node",
                gpus=self.gpus,
                extra_env=dict(self.worker_env),
                image_roots=dict(self.image_roots),
            )
        self._node_started = True  # stop() undoes a partial start too
        self.node.start()

    def operator_log(self) -> Path:
        """The operator's log: its process's, or its pod's container log on the node."""
        if self.release is not None and self._node_started:
            pod = self.release.operator_pod()
            if pod is not None:
                logs = self.node.pod_logs(self.release.namespace, pod["metadata"]["name"])
                if logs:
                    return logs[-1]
        return self.state_dir / "operator.log"

    def operator_log_tail(self, lines: int = 40) -> str:
        try:
            text = self.operator_log().read_text(errors="replace").splitlines()
        except OSError:
            return "(no operator log)"
        return "\n".join(text[-lines:])

    def check_operator(self) -> None:
        if self.release is not None:
            # No pod: the release is rolling (upgrade) or uninstalled; its own waits report.
            # Every replica counts: a standby that restarts is as wrong as a leader that does.
            for pod in self.release.live_operator_pods():
                statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
                state = statuses[0].get("state") or {}
                if "terminated" in state or statuses[0].get("restartCount"):
                    raise RuntimeError(
                        f"operator pod {pod['metadata']['name']} is not running ({state}):\n"
                        f"{self.operator_log_tail()}"
                    )
        if self._operator is not None and self._operator.poll() is not None:
            raise RuntimeError(
                f"operator exited with {self._operator.returncode}:\n{self.operator_log_tail()}"
            )
        for identity, proc in self._elected.items():
            if proc.poll() is not None:  # e.g. a leader that could not renew its Lease
                tail = self.candidate_log(identity).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"operator {identity} exited with {proc.returncode}:\n{tail}")

    # -- down
    def down(self) -> None:
        """Operator and LWS first (so nothing is recreated), then every worker process, then the
        cluster."""
        self._stop_operators()
        if self._lws is not None:
            self._lws.down()
            self._lws = None
        if self._node_started:
            self.node.stop(timeout=20.0)
            self._node_started = False
        if self._net is not None:  # a node that never started: its network alone
            from weightlift.local.kubeletnode import release_network

            release_network(self._net, self.state_dir / "node")
            self._net = None
        if self._cluster is not None:
            self._cluster.down()
            self._cluster = None
        with contextlib.suppress(AttributeError):
            self.kube.close()
        if self.release is not None:
            self.release.close()

    # -- helpers for the demo and tests
    def apply(self, manifest: JSON) -> JSON:
        ns = manifest["metadata"].get("namespace", self.namespace)
        name = manifest["metadata"]["name"]
        try:
            return call(self.kube.custom.create_namespaced_custom_object, *_md(ns), manifest)
        except ApiException as exc:
            if exc.status != 409:
                raise
        return self.patch_md(name, {"spec": manifest["spec"]}, namespace=ns)

    def patch_md(self, name: str, patch: JSON, namespace: str | None = None) -> JSON:
        """Merge-patch a ModelDeployment (its spec, labels...)."""
        ns = namespace or self.namespace
        return call(
            self.kube.custom.patch_namespaced_custom_object,
            *_md(ns),
            name,
            patch,
            _content_type=MERGE,
        )

    def scale_md(self, name: str, replicas: int) -> JSON:
        """Scale a ModelDeployment through its scale subresource (as kubectl scale, an HPA)."""
        return call(
            self.kube.custom.patch_namespaced_custom_object_scale,
            *_md(self.namespace),
            name,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE,
        )

    def get_md(self, name: str) -> JSON | None:
        return get_or_none(
            self.kube.custom.get_namespaced_custom_object, *_md(self.namespace), name
        )

    def pods(self, name: str) -> list[JSON]:
        listing = call(
            self.kube.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{DEPLOYMENT_LABEL}={name}",
        )
        items: list[JSON] = listing["items"]
        return items

    def events(self, involved: str | None = None) -> list[JSON]:
        """The namespace's Events; those about the object named `involved` when given."""
        selector = f"involvedObject.name={involved}" if involved else None
        listing = call(
            self.kube.core.list_namespaced_event, self.namespace, field_selector=selector
        )
        items: list[JSON] = listing["items"]
        return items

    def delete_md(self, name: str) -> None:
        delete(self.kube.custom.delete_namespaced_custom_object, *_md(self.namespace), name)


def _md(namespace: str) -> tuple[str, str, str, str]:
    """The custom objects API's first arguments for ModelDeployments in `namespace`."""
    return GROUP, VERSION, namespace, PLURAL


# ------------------------------------------------------------------------------ the model


def make_demo_model(
    out: Path, size_mb: float, *, hook: bool = True, seed: int = 0, tp: int = 1
) -> JSON:
    """Run `weightlift model make-demo` (torch stays out of this process); return probe.json.
    `tp`: tensor-parallel ranks, one file each (rank-<r>-of-<tp>.safetensors)."""
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
        "--tp",
        str(tp),
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
    warm_spares: int = 0,
    parallelism: JSON | None = None,
    image: str | None = None,
) -> JSON:
    """A ModelDeployment for a local demo model, pinned to the stack's node. `image`: the worker
    image (a kubelet node runs it; default: the CRD's). `model` overrides
    spec.model fields (another uri, endpoint, credentials: see local/demo_stores.py). engine "vLLM":
    an HF model directory served by vLLM with weightlift loading (the init hook runs in each
    vLLM rank's process). engine "Triton": the same inside tritonserver's Python backend
    (Triton's HTTP on VLLM_PORT, metrics 8002, gRPC 8003), probed through its generate."""
    vllm = engine in ("vLLM", "Triton")
    spec: JSON = {
        "model": {
            "uri": f"hostpath://{model_dir.resolve()}",
            "format": "safetensors" if vllm else "pt2",
            "revision": revision,
            "name": name,
            **(model or {}),
        },
        "replicas": replicas,
        **({"warmSpares": warm_spares} if warm_spares else {}),
        **({"parallelism": parallelism} if parallelism else {}),
        "template": {
            "nodeSelector": {LOCAL_NODE_LABEL: "true"},
            "shmSize": "1Gi",
            **({"image": image} if image else {}),
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
        kept = {k: v for k, v in probe.items() if k in keep}
        if engine == "Triton" and "completion" in kept:  # probed through Triton's generate
            kept["completion"] = {**kept["completion"], "protocol": "TritonGenerate"}
        spec["probe"] = {
            **kept,
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


def add_hook_library(model_dir: Path) -> Path:
    """The demo's recording init hook (gcc) in `model_dir`/hooks, as the PT2 demo model has."""
    from weightlift.local.models import build_hook_library

    lib = model_dir / "hooks" / "libinit.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        build_hook_library(lib)
    return lib


def _image_values(image: str) -> JSON:
    """The chart's `image` values (the operator's, workerBundle's) for `repository:tag` (none for
    an empty name)."""
    if not image:
        return {}
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:
        raise ValueError(f"image {image!r}: expected repository:tag")
    return {"image": {"repository": repository, "tag": tag}}
