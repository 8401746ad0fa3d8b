"""A real local Kubernetes control plane for tests, the demo and `weightlift cluster up`.

etcd, kube-apiserver (TLS on 127.0.0.1, static-token admin in system:masters, service-account
signing keys, Node,RBAC authorization), kube-controller-manager (garbage collector, service
accounts and their tokens), kube-scheduler and kwok (simulated GPU nodes; pods bound to them
become Running/Ready through kwok's default stages). The binaries are built from Go modules by
``hack/build-controlplane.sh`` (``make controlplane``); kubectl and helm come from
``hack/install_tools.py`` (``make tools``).

Python API::

    with ControlPlane(Path(".state")) as info:   # or cp.up() ... cp.down()
        os.environ["KUBECONFIG"] = str(info.kubeconfig)

Every process is started in its own session with its log in ``STATE/logs/<name>.log`` and its
pid in ``STATE/pids.json``; ``down`` stops them by pid (SIGTERM, then SIGKILL) and only after
checking that the pid still runs the binary we started.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from weightlift.local.certs import new_ca, pem, signed
from weightlift.local.net import free_ports
from weightlift.local.procs import child_options, pid_runs, stop_group, stop_pid

# Pinned versions. hack/build-controlplane.sh and hack/install_tools.py carry the same values
# (tests/integration/test_cluster_live.py checks they agree).
K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
KWOK_VERSION = "v0.8.0"
KUBECTL_LAYER_VERSION = "2.2.2"

CONTROLPLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
TOOLS = ("kubectl", "helm")

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
ADMIN_USER = "weightlift-admin"
SERVICE_CIDR = "10.96.0.0/16"
# kwok hands simulated pods addresses from this range. Loopback on purpose: nothing may send
# traffic to made-up private addresses from this machine, and 127.244/16 stays clear of the
# process node's 127.0.x.y worker addresses.
POD_CIDR = "127.244.0.0/16"
# kwokctl's value for "no client rate limit" (its --disable-qps-limits).
UNLIMITED_QPS = 5000


class ControlPlaneError(RuntimeError):
    """A component is missing, failed to start or did not become ready."""


# ----------------------------------------------------------------------------- locating binaries


def cache_dir() -> Path:
    """The build cache: ``$WL_CACHE`` or ``~/.cache/weightlift`` (the Makefile's default)."""
    env = os.environ.get("WL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "weightlift"


def cached_binary(
    name: str, version: str, error: type[Exception], cache: Path | None = None
) -> Path:
    """`name` as `make <name>` (hack/build-<name>.sh) caches it: <cache>/<name>-<version>/bin;
    `error` names the make target when it is not there."""
    base = cache if cache is not None else cache_dir()
    path = base / f"{name}-{version}" / "bin" / name
    if not os.access(path, os.X_OK):
        raise error(
            f"{name} not found at {path}: build it with `make {name}` (hack/build-{name}.sh {base})"
        )
    return path


def controlplane_bin_dir(cache: Path | None = None) -> Path:
    base = cache if cache is not None else cache_dir()
    return base / f"controlplane-k8s{K8S_VERSION}-etcd{ETCD_VERSION}-kwok{KWOK_VERSION}" / "bin"


def tools_bin_dir(cache: Path | None = None) -> Path:
    base = cache if cache is not None else cache_dir()
    return base / f"tools-kubectl-v35-{KUBECTL_LAYER_VERSION}" / "bin"


def kwok_stages_file(cache: Path | None = None) -> Path:
    """kwok's node/pod stages (node-initialize, heartbeat, pod-ready/complete/delete)."""
    return controlplane_bin_dir(cache).parent / "kwok-stages.yaml"


def missing_binaries(cache: Path | None = None) -> list[str]:
    """Names of control-plane binaries and tools that are not built/installed yet."""
    cp, tools = controlplane_bin_dir(cache), tools_bin_dir(cache)
    missing = [b for b in CONTROLPLANE_BINARIES if not os.access(cp / b, os.X_OK)]
    if not kwok_stages_file(cache).is_file():
        missing.append("kwok-stages.yaml")
    return missing + [t for t in TOOLS if not os.access(tools / t, os.X_OK)]


def binary_path(name: str, cache: Path | None = None) -> Path:
    """Path of a control-plane binary; a clear error (run `make controlplane`) when absent."""
    path = controlplane_bin_dir(cache) / name
    if not os.access(path, os.X_OK):
        raise ControlPlaneError(
            f"{name} not found at {path}: build the control plane first with `make controlplane` "
            f"(hack/build-controlplane.sh {cache if cache is not None else cache_dir()})"
        )
    return path


def tool_path(name: str, cache: Path | None = None) -> Path:
    """Path of ``kubectl`` or ``helm`` from the cache (``make tools``), else from ``$PATH``."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; known: {TOOLS}")
    path = tools_bin_dir(cache) / name
    if os.access(path, os.X_OK):
        return path
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise ControlPlaneError(
        f"{name} not found at {path} nor on PATH: install it with `make tools` "
        f"(hack/install_tools.py --cache {cache if cache is not None else cache_dir()})"
    )


# ----------------------------------------------------------------------------------- certificates


def _write_certs(certs: Path, bind_address: str = "127.0.0.1") -> None:
    """A CA, the apiserver's serving cert (also for `bind_address`), its client cert for the
    kubelets (system:masters: logs, exec) and the service-account signing key pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    certs.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = new_ca("weightlift-local-ca")
    sans: list[x509.GeneralName] = [
        x509.DNSName(n)
        for n in (
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        )
    ]
    ips = {"127.0.0.1", bind_address, str(next(ipaddress.IPv4Network(SERVICE_CIDR).hosts()))}
    sans += [x509.IPAddress(ipaddress.IPv4Address(ip)) for ip in sorted(ips)]
    server_key, server_cert = signed(ca_key, ca_cert, "kube-apiserver", server_names=sans)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (certs / "ca.crt").write_bytes(pem(ca_cert))
    (certs / "ca.key").write_bytes(pem(ca_key))
    (certs / "apiserver.crt").write_bytes(pem(server_cert))
    (certs / "apiserver.key").write_bytes(pem(server_key))
    (certs / "sa.key").write_bytes(pem(sa_key))
    (certs / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    for key in ("ca.key", "apiserver.key", "sa.key"):
        (certs / key).chmod(0o600)
    issue_client_cert(certs, "apiserver-kubelet-client", "kube-apiserver", ("system:masters",))


def issue_client_cert(
    certs: Path, name: str, common_name: str, orgs: Sequence[str], out_dir: Path | None = None
) -> tuple[Path, Path]:
    """A client certificate from the local CA (``certs``/ca.{crt,key}): the API server takes
    CN as the user and O as its groups (a kubelet is ``system:node:<node>`` in
    ``system:nodes``, as kubeadm issues it). Returns (cert, key) in ``out_dir`` (default:
    ``certs``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    ca_key: Any = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    key, cert = signed(ca_key, ca_cert, common_name, orgs=orgs)
    out = out_dir if out_dir is not None else certs
    out.mkdir(parents=True, exist_ok=True)
    crt_path, key_path = out / f"{name}.crt", out / f"{name}.key"
    crt_path.write_bytes(pem(cert))
    key_path.write_bytes(pem(key))
    key_path.chmod(0o600)
    return crt_path, key_path


# ------------------------------------------------------------------------------------ data types


@dataclass(frozen=True)
class GpuNodeSpec:
    """What a simulated GPU node looks like (labels as NVIDIA's GPU feature discovery sets)."""

    count: int = 4
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    instance_type: str = "p5.48xlarge"
    cpu: str = "192"
    memory: str = "2048Gi"
    name_prefix: str = "gpu-node"

    def names(self) -> list[str]:
        return [f"{self.name_prefix}-{i}" for i in range(self.count)]


@dataclass(frozen=True)
class ClusterInfo:
    """How to reach a running local control plane."""

    state_dir: Path
    kubeconfig: Path
    server: str
    token: str
    ca_file: Path
    nodes: tuple[str, ...]
    ports: dict[str, int] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: os.environ) with KUBECONFIG pointing at this cluster."""
        out = dict(os.environ if base is None else base)
        out["KUBECONFIG"] = str(self.kubeconfig)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "stateDir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "caFile": str(self.ca_file),
            "nodes": list(self.nodes),
            "ports": self.ports,
        }


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# ---------------------------------------------------------------------------------- control plane


class ControlPlane:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok with simulated GPU nodes."""

    def __init__(
        self,
        state_dir: Path,
        *,
        nodes: GpuNodeSpec | None = None,
        cache: Path | None = None,
        timeout: float = 120.0,
        bind_to_parent: bool = False,
        unlimited_client_qps: bool = False,
        apiserver_args: Sequence[str] = (),
        kwok_pod_parallelism: int = 0,
        bind_address: str = "127.0.0.1",
    ) -> None:
        """``bind_to_parent``: components get SIGTERM when the process that started them dies
        (Linux PR_SET_PDEATHSIG), so a killed test run leaves nothing behind. Off for
        `weightlift cluster up`, whose components must outlive the command.

        ``unlimited_client_qps``: lift the scheduler's and controller-manager's client rate
        limits (50 QPS by default: 4000 pod bindings would take 80 s), as kwokctl's
        ``--disable-qps-limits`` does for scale tests. ``apiserver_args``: extra kube-apiserver
        flags (the operator benchmark's audit log). ``kwok_pod_parallelism``: pods kwok moves
        through their stages at once (kwok's default, 4, stands in for every kubelet of the
        cluster: thousands of pods queue behind it). ``bind_address``: where the API server
        listens and what it advertises (the `kubernetes` Service's endpoint); a real node's
        pods reach it there (local/kubeletnode/), loopback otherwise."""
        self.bind_address = bind_address
        self.bind_to_parent = bind_to_parent
        self.unlimited_client_qps = unlimited_client_qps
        self.apiserver_args = tuple(apiserver_args)
        self.kwok_pod_parallelism = kwok_pod_parallelism
        self.state_dir = Path(state_dir).resolve()
        self.nodes = nodes if nodes is not None else GpuNodeSpec()
        self.cache = cache
        self.timeout = timeout
        self.logs = self.state_dir / "logs"
        self.certs = self.state_dir / "certs"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.pids_file = self.state_dir / "pids.json"
        self.info_file = self.state_dir / "cluster.json"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._argv: dict[str, list[str]] = {}  # what each component was started with
        self._info: ClusterInfo | None = None

    # -- context manager
    def __enter__(self) -> ClusterInfo:
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    # -- public API
    def up(self) -> ClusterInfo:
        """Start every component (fresh etcd data), wait until ready, create the GPU nodes."""
        bins = {name: str(binary_path(name, self.cache)) for name in CONTROLPLANE_BINARIES}
        stages = kwok_stages_file(self.cache)
        if not stages.is_file():
            raise ControlPlaneError(f"{stages} not found: run `make controlplane`")
        started = time.monotonic()
        token = self._fresh_state()
        names = ("etcd", "etcdPeer", "apiserver", "controllerManager", "scheduler", "kwok")
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        server = f"https://{self.bind_address}:{ports['apiserver']}"
        self._write_kubeconfig(server, token)
        info = ClusterInfo(
            state_dir=self.state_dir,
            kubeconfig=self.kubeconfig,
            server=server,
            token=token,
            ca_file=self.certs / "ca.crt",
            nodes=tuple(self.nodes.names()),
            ports=ports,
        )
        try:
            self._start("etcd", self._etcd_argv(bins["etcd"], ports))
            self._wait_http("etcd", f"http://127.0.0.1:{ports['etcd']}/health", verify=False)
            self._start("kube-apiserver", self._apiserver_argv(bins["kube-apiserver"], ports))
            self._wait_http("kube-apiserver", f"{server}/readyz", token=token)
            cm, sched = ports["controllerManager"], ports["scheduler"]
            self._start(
                "kube-controller-manager",
                self._controller_manager_argv(bins["kube-controller-manager"], cm),
            )
            self._start("kube-scheduler", self._scheduler_argv(bins["kube-scheduler"], sched))
            self._start("kwok", self._kwok_argv(bins["kwok"], stages, ports["kwok"]))
            self._wait_http(
                "kube-controller-manager", f"https://127.0.0.1:{cm}/healthz", verify=False
            )
            self._wait_http("kube-scheduler", f"https://127.0.0.1:{sched}/healthz", verify=False)
            self._save_pids()
            self._create_nodes(info)
            self._wait_cluster_usable(info)
        except BaseException:
            self._save_pids()
            self.down()
            raise
        self._info = info
        up_seconds = round(time.monotonic() - started, 2)
        doc = {**info.to_json(), "upSeconds": up_seconds}
        self.info_file.write_text(json.dumps(doc, indent=2) + "\n")
        return info

    def _fresh_state(self) -> str:
        """Stop a previous run in this state dir, start its dirs afresh, write certificates and
        the admin token file; returns the admin token."""
        self.down()
        for sub in ("etcd", "certs", "logs", "run"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "run").mkdir(parents=True, exist_ok=True)
        _write_certs(self.certs, self.bind_address)
        token = secrets.token_hex(24)
        tokens = self.certs / "tokens.csv"
        tokens.write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        tokens.chmod(0o600)
        return token

    # -- each component's command line
    def _etcd_argv(self, exe: str, ports: dict[str, int]) -> list[str]:
        client, peer = ports["etcd"], ports["etcdPeer"]
        return [
            exe,
            "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ]

    def _apiserver_argv(self, exe: str, ports: dict[str, int]) -> list[str]:
        c = self.certs
        return [
            exe,
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
            f"--bind-address={self.bind_address}",
            f"--advertise-address={self.bind_address}",
            f"--secure-port={ports['apiserver']}",
            f"--cert-dir={c}",
            f"--tls-cert-file={c / 'apiserver.crt'}",
            f"--tls-private-key-file={c / 'apiserver.key'}",
            f"--client-ca-file={c / 'ca.crt'}",
            f"--token-auth-file={c / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={c / 'sa.pub'}",
            f"--service-account-signing-key-file={c / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            *self._endpoint_args(),
            # logs/exec on a real node: its InternalIP (no DNS for node names), our client cert
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={c / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={c / 'apiserver-kubelet-client.key'}",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v=1",
            *self.apiserver_args,
        ]

    def _endpoint_args(self) -> list[str]:
        # A 127.0.0.1 endpoint is invalid: no `kubernetes` Service endpoint on loopback.
        loopback = ipaddress.ip_address(self.bind_address).is_loopback
        return ["--endpoint-reconciler-type=none"] if loopback else []

    def _client_argv(self, name: str, port: int) -> list[str]:
        """What the controller manager and the scheduler share: kubeconfigs, port, certs."""
        kc = str(self.kubeconfig)
        return [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={self.state_dir / 'run' / name}",
            "--leader-elect=false",
            "--v=1",
            *self._client_qps_args(),
        ]

    def _controller_manager_argv(self, exe: str, port: int) -> list[str]:
        c = self.certs
        return [
            exe,
            *self._client_argv("kube-controller-manager", port),
            "--use-service-account-credentials=false",
            f"--service-account-private-key-file={c / 'sa.key'}",
            f"--root-ca-file={c / 'ca.crt'}",
            f"--cluster-signing-cert-file={c / 'ca.crt'}",
            f"--cluster-signing-key-file={c / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle",
            "--concurrent-gc-syncs=5",
        ]

    def _scheduler_argv(self, exe: str, port: int) -> list[str]:
        return [exe, *self._client_argv("kube-scheduler", port)]

    def _kwok_argv(self, exe: str, stages: Path, port: int) -> list[str]:
        return [
            exe,
            f"--kubeconfig={self.kubeconfig}",
            f"--config={stages}",
            *self._kwok_config_args(),
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            f"--cidr={POD_CIDR}",
            "--node-ip=10.240.0.1",
            f"--server-address=127.0.0.1:{port}",
            "--node-lease-duration-seconds=40",
        ]

    def down(self) -> list[str]:
        """Stop every process this state dir started; returns the names that were stopped."""
        entries: dict[str, dict[str, Any]] = {}
        if self.pids_file.exists():
            with contextlib.suppress(ValueError, OSError):
                entries = json.loads(self.pids_file.read_text())
        for name, proc in self._procs.items():
            entries.setdefault(name, {"pid": proc.pid, "exe": str(proc.args[0])})  # type: ignore[index]
        stopped: list[str] = []
        # reverse start order: kwok, scheduler, controller-manager, apiserver, etcd
        for name in reversed(list(entries)):
            pid, exe = int(entries[name]["pid"]), str(entries[name]["exe"])
            if pid_runs(pid, exe):
                stop_pid(pid, exe, grace=10.0)
                stopped.append(name)
            child = self._procs.get(name)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1)
        self._procs.clear()
        with contextlib.suppress(FileNotFoundError):
            self.pids_file.unlink()
        return stopped

    def restart(self, name: str, down_seconds: float = 0.0) -> None:
        """Stop one component (SIGTERM, as a node reboot or an upgrade would), leave it down for
        `down_seconds`, start it again with the same flags and wait until it answers (the chaos
        bench restarts the kube-apiserver under a running operator)."""
        proc, argv = self._procs.get(name), self._argv.get(name)
        if proc is None or argv is None or self._info is None:
            raise ControlPlaneError(f"{name} was not started by this ControlPlane")
        stop_group(proc, grace=10.0)
        time.sleep(down_seconds)
        self._start(name, argv)
        if name == "kube-apiserver":
            info = self._info
            self._wait_http(name, f"{info.server}/readyz", token=info.token)

    def running(self) -> dict[str, int]:
        """name -> pid of the components recorded in the state dir that are still alive."""
        if not self.pids_file.exists():
            return {}
        entries = json.loads(self.pids_file.read_text())
        return {
            n: int(e["pid"]) for n, e in entries.items() if pid_runs(int(e["pid"]), str(e["exe"]))
        }

    # -- internals
    def _kwok_config_args(self) -> list[str]:
        if not self.kwok_pod_parallelism:
            return []
        # A KwokConfiguration document skips kwok's defaults for the options it leaves out.
        options = {
            "podPlayStageParallelism": self.kwok_pod_parallelism,
            "nodePlayStageParallelism": 4,
            "nodeLeaseParallelism": 4,
            "podsOnNodeSyncParallelism": 1,
        }
        doc = {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokConfiguration",
            "options": options,
        }
        path = self.state_dir / "run" / "kwok-options.yaml"
        path.write_text(yaml.safe_dump(doc))
        return [f"--config={path}"]

    def _client_qps_args(self) -> list[str]:
        if not self.unlimited_client_qps:
            return []
        return [f"--kube-api-qps={UNLIMITED_QPS}", f"--kube-api-burst={2 * UNLIMITED_QPS}"]

    def _start(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        try:
            # SIGTERM on the parent's death: etcd and the API server get to shut down cleanly.
            proc = subprocess.Popen(
                list(argv),
                **child_options(
                    log,
                    cwd=self.state_dir,
                    die_with=signal.SIGTERM if self.bind_to_parent else None,
                ),
            )
        finally:
            log.close()
        self._procs[name] = proc
        self._argv[name] = list(argv)
        self._save_pids()

    def _save_pids(self) -> None:
        data = {n: {"pid": p.pid, "exe": str(p.args[0])} for n, p in self._procs.items()}  # type: ignore[index]
        if data:
            self.pids_file.write_text(json.dumps(data, indent=2) + "\n")

    def _check_alive(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            log = self.logs / f"{name}.log"
            raise ControlPlaneError(
                f"{name} exited with code {proc.returncode} during startup; "
                f"last lines of {log}:\n{_log_tail(log)}"
            )

    def _wait_http(
        self, name: str, url: str, *, token: str | None = None, verify: bool = True
    ) -> None:
        ctx: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(self.certs / "ca.crt")) if verify else False
        )
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + self.timeout
        last = ""
        with httpx.Client(verify=ctx, timeout=5.0, headers=headers) as client:
            while time.monotonic() < deadline:
                for n in self._procs:
                    self._check_alive(n)
                try:
                    r = client.get(url)
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}: {r.text[-500:]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                time.sleep(0.2)
        log = self.logs / f"{name}.log"
        raise ControlPlaneError(
            f"{name} not ready at {url} after {self.timeout:.0f}s ({last}); "
            f"last lines of {log}:\n{_log_tail(log)}"
        )

    def _write_kubeconfig(self, server: str, token: str) -> None:
        ca = base64.b64encode((self.certs / "ca.crt").read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "weightlift",
                    "cluster": {"server": server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": ADMIN_USER, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "weightlift",
                    "context": {
                        "cluster": "weightlift",
                        "user": ADMIN_USER,
                        "namespace": "default",
                    },
                }
            ],
            "current-context": "weightlift",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _api(self, info: ClusterInfo) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(info.ca_file))
        return httpx.Client(
            base_url=info.server,
            verify=ctx,
            timeout=10.0,
            headers={"Authorization": f"Bearer {info.token}"},
        )

    def _node_manifest(self, name: str) -> dict[str, Any]:
        n = self.nodes
        resources = {
            "cpu": n.cpu,
            "memory": n.memory,
            "pods": "110",
            "ephemeral-storage": "7Ti",
            "nvidia.com/gpu": str(n.gpus_per_node),
            # an RDMA device plugin's resource, one HCA per GPU (examples request rdma/ib)
            "rdma/ib": str(n.gpus_per_node),
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    "node.kubernetes.io/instance-type": n.instance_type,
                    "topology.kubernetes.io/region": "local",
                    "topology.kubernetes.io/zone": "local-a",
                    "nvidia.com/gpu.present": "true",
                    "nvidia.com/gpu.product": n.gpu_product,
                    "nvidia.com/gpu.count": str(n.gpus_per_node),
                    "nvidia.com/gpu.memory": str(n.gpu_memory_mib),
                },
            },
            "spec": {},
            "status": {
                "allocatable": resources,
                "capacity": resources,
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": f"{K8S_VERSION}-kwok",
                    "kubeProxyVersion": "",
                },
            },
        }

    def _create_nodes(self, info: ClusterInfo) -> None:
        with self._api(info) as api:
            for name in info.nodes:
                r = api.post("/api/v1/nodes", json=self._node_manifest(name))
                if r.status_code not in (201, 409):
                    raise ControlPlaneError(f"creating node {name}: HTTP {r.status_code} {r.text}")

    def _wait_cluster_usable(self, info: ClusterInfo) -> None:
        """Nodes Ready (kwok took them over) and the default ServiceAccount exists."""
        deadline = time.monotonic() + self.timeout
        waiting_for = "nodes"
        with self._api(info) as api:
            while time.monotonic() < deadline:
                for n in self._procs:
                    self._check_alive(n)
                try:
                    nodes = api.get("/api/v1/nodes").json().get("items", [])
                    ready = {
                        nd["metadata"]["name"]
                        for nd in nodes
                        if any(
                            cond.get("type") == "Ready" and cond.get("status") == "True"
                            for cond in nd.get("status", {}).get("conditions", []) or []
                        )
                    }
                    if not set(info.nodes) <= ready:
                        waiting_for = f"nodes Ready (ready: {sorted(ready)})"
                    elif (
                        api.get("/api/v1/namespaces/default/serviceaccounts/default").status_code
                        != 200
                    ):
                        waiting_for = "default ServiceAccount (kube-controller-manager)"
                    else:
                        return
                except httpx.HTTPError as exc:
                    waiting_for = repr(exc)
                time.sleep(0.2)
        raise ControlPlaneError(
            f"cluster not usable after {self.timeout:.0f}s: waiting for {waiting_for}; "
            f"kwok log:\n{_log_tail(self.logs / 'kwok.log')}\n"
            f"kube-controller-manager log:\n{_log_tail(self.logs / 'kube-controller-manager.log')}"
        )
