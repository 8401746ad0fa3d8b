"""What `weightlift bench operator` runs: a real control plane with kwok GPU nodes, the
simulated workers (simworkers.py) and the real operator as a subprocess under its own
ServiceAccount, whose API requests the kube-apiserver's audit log records.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.bench import apiaudit
from weightlift.local.cluster import POD_CIDR, ClusterInfo, ControlPlane, GpuNodeSpec
from weightlift.local.kube import Kube, call, get_or_none
from weightlift.local.net import free_port
from weightlift.local.procs import UpDown, child_options, stop_group
from weightlift.local.stack import apply_crd

NAMESPACE = "wl-bench"
OPERATOR_SA = "weightlift-operator"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SA}"
PROFILERS = ("none", "py-spy", "cprofile", "tracemalloc")
# kwok plays every kubelet of the cluster; its default (4 pods at a time) made pods wait ~35 s
# for Running at 400 pods, time no real cluster of 13+ nodes would spend.
KWOK_POD_PARALLELISM = 64


class ProcessMeter:
    """CPU seconds and peak RSS of one process, read from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ticks = os.sysconf("SC_CLK_TCK")

    def cpu_seconds(self) -> float:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.ticks  # utime + stime

    def _status_kb(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def peak_rss_mb(self) -> float:
        return self._status_kb("VmHWM") / 1024

    def rss_mb(self) -> float:
        return self._status_kb("VmRSS") / 1024


def _python_descendant(pid: int, timeout: float = 30.0) -> int:
    """The operator's python process under a profiler wrapper (py-spy runs it as a child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.1)
    raise RuntimeError(f"profiler {pid} started no operator process within {timeout}s")


@dataclass
class BenchStack(UpDown):
    """Up in `__enter__` (cluster, CRD, namespace, operator identity, simulated workers);
    the operator starts with `start_operator`; everything stops in `__exit__`."""

    state_dir: Path
    pods: int  # worker pods the run will need (deployments x replicas)
    gpus_per_pod: int
    gpus_per_node: int
    profiler: str = "none"

    worker_port: int = field(init=False, default=0)
    info: ClusterInfo = field(init=False)
    kube: Kube = field(init=False)
    operator_pid: int = field(init=False, default=0)
    _cluster: ControlPlane | None = field(init=False, default=None)
    _sim: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _operator: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "audit.log"

    @property
    def profile_path(self) -> Path:
        suffix = {"py-spy": "pyspy.txt", "cprofile": "prof", "tracemalloc": "tracemalloc"}.get(
            self.profiler, "none"
        )
        return self.state_dir / f"operator.{suffix}"

    def up(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.audit_log.unlink(missing_ok=True)
        policy = self.state_dir / "audit-policy.yaml"
        policy.write_text(apiaudit.policy(OPERATOR_USER))
        # No node holds more than 110 pods (the kubelet default kwok nodes advertise).
        per_node = max(1, min(self.gpus_per_node // self.gpus_per_pod, 100))
        nodes = GpuNodeSpec(count=math.ceil(self.pods / per_node), gpus_per_node=self.gpus_per_node)
        self._cluster = ControlPlane(
            self.state_dir / "cluster",
            nodes=nodes,
            bind_to_parent=True,
            unlimited_client_qps=True,
            apiserver_args=apiaudit.apiserver_args(policy, self.audit_log),
            kwok_pod_parallelism=KWOK_POD_PARALLELISM,
        )
        self.info = self._cluster.up()
        self.kube = Kube(self.info.kubeconfig, "bench-operator-stack")
        apply_crd(self.kube)
        self._operator_identity()
        self._wait_served()
        self._start_sim()

    def _operator_identity(self) -> None:
        """Namespace, the operator's ServiceAccount (cluster-admin) and a kubeconfig with its
        token: the audit policy records exactly this user."""
        core = self.kube.core
        call(core.create_namespace, {"metadata": {"name": NAMESPACE}})
        call(core.create_namespaced_service_account, NAMESPACE, {"metadata": {"name": OPERATOR_SA}})
        binding = {
            "metadata": {"name": "weightlift-bench-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": NAMESPACE}],
        }
        call(client.RbacAuthorizationV1Api(self.kube.api).create_cluster_role_binding, binding)
        request = {"spec": {"expirationSeconds": 6 * 3600}}
        issued = call(core.create_namespaced_service_account_token, OPERATOR_SA, NAMESPACE, request)
        token = issued["status"]["token"]
        doc = yaml.safe_load(self.info.kubeconfig.read_text())
        doc["users"] = [{"name": "operator", "user": {"token": token}}]
        doc["contexts"][0]["context"].update(user="operator", namespace=NAMESPACE)
        path = self.state_dir / "operator.kubeconfig"
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        self.operator_kubeconfig = path
        # Worker pods are admitted only once the namespace's default ServiceAccount exists.
        deadline = time.monotonic() + 60
        while get_or_none(core.read_namespaced_service_account, "default", NAMESPACE) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no default ServiceAccount in {NAMESPACE} after 60s")
            time.sleep(0.2)

    def _wait_served(self, timeout: float = 60.0) -> None:
        """Until the API server lists ModelDeployments in NAMESPACE (a new CRD's storage takes
        a moment to start)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                call(
                    self.kube.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    NAMESPACE,
                    PLURAL,
                )
                return
            except ApiException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _start_sim(self) -> None:
        self.worker_port = free_port("0.0.0.0")
        ready = self.state_dir / "sim.ready"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "weightlift.bench.simworkers"]
        argv += ["--port", str(self.worker_port), "--cidr", POD_CIDR, "--ready-file", str(ready)]
        self._sim = self._spawn(argv, self.state_dir / "sim.log", dict(os.environ))
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self._sim.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulated workers did not start; see {self.state_dir}/sim.log")
            time.sleep(0.05)

    @property
    def sim_pid(self) -> int:
        assert self._sim is not None
        return self._sim.pid

    def sim_stats(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.worker_port}/sim/stats"
        stats: dict[str, Any] = httpx.get(url, timeout=10, trust_env=False).json()
        return stats

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:  # one run per log
            # SIGTERM when the bench dies (a `timeout`, a Ctrl-C): no operator left polling.
            return subprocess.Popen(argv, **child_options(out, env=env, die_with=signal.SIGTERM))

    def start_operator(self, timeout: float = 120.0) -> None:
        """`weightlift operator -n NAMESPACE`; returns once its watches are open."""
        liveness = free_port("0.0.0.0")
        argv = [sys.executable, "-m", "weightlift", "operator", "-n", NAMESPACE]
        argv += ["--liveness-port", str(liveness), "--probe-networks", POD_CIDR]
        # bench/operator.py's models are file:///models/... (never read: kwok nodes)
        argv += ["--model-path-prefix", "/models"]
        if self.profiler == "cprofile":
            argv = [sys.executable, "-m", "cProfile", "-o", str(self.profile_path), *argv[1:]]
        elif self.profiler == "tracemalloc":
            memtrace = [sys.executable, "-m", "weightlift.bench.memtrace", str(self.profile_path)]
            argv = [*memtrace, *argv[2:]]
        elif self.profiler == "py-spy":
            spy = str(Path(sys.executable).parent / "py-spy")
            record = [spy, "record", "--format", "raw", "--full-filenames", "--nonblocking"]
            record += ["--rate", "50"]
            argv = [*record, "--output", str(self.profile_path), "--", *argv]
        env = {**os.environ, "KUBECONFIG": str(self.operator_kubeconfig), "PYTHONUNBUFFERED": "1"}
        self._operator = self._spawn(argv, self.state_dir / "operator.log", env)
        pid = self._operator.pid
        self.operator_pid = _python_descendant(pid) if self.profiler == "py-spy" else pid
        deadline = time.monotonic() + timeout
        wanted = {"modeldeployments", "pods"}
        while not apiaudit.watching(self.audit_log, wanted):
            if self._operator.poll() is not None:
                raise RuntimeError(f"operator exited; see {self.state_dir}/operator.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"operator opened no watch on {wanted} within {timeout}s")
            time.sleep(0.2)

    def component_pids(self) -> dict[str, int]:
        """Every process of the benchmark by name: the operator, the simulated workers and the
        control plane's components (for their CPU seconds)."""
        assert self._cluster is not None
        ours = {"operator": self.operator_pid, "simworkers": self.sim_pid}
        return {**{name: pid for name, pid in ours.items() if pid}, **self._cluster.running()}

    def operator_alive(self) -> bool:
        return self._operator is not None and self._operator.poll() is None

    def stop_operator(self) -> None:
        if self._operator is not None:
            # SIGINT: kopf stops gracefully; cProfile and py-spy then write their files.
            stop_group(self._operator, grace=60.0, first=signal.SIGINT)
            self._operator = None

    def down(self) -> None:
        self.stop_operator()
        if self._sim is not None:
            stop_group(self._sim, grace=10.0)
            self._sim = None
        if self._cluster is not None:
            self._cluster.down()
            self._cluster = None
        with contextlib.suppress(AttributeError):
            self.kube.close()
