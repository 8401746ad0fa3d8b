"""A real Prometheus for the local stack: it finds the operator and the workers through
Kubernetes service discovery and scrapes them, as a platform team's Prometheus would.

Built from Go modules by hack/build-prometheus.sh (`make prometheus`) into the same cache as the
control plane. It runs on the host and talks to the local API server as the ServiceAccount
`prometheus` of namespace `monitoring` (a TokenRequest token; only the read access to pods,
Services and EndpointSlices that Kubernetes service discovery needs, bound per namespace).

What it scrapes is what the chart and the operator ship, nothing the stack adds:
- the operator: the chart's metrics Service (`app.kubernetes.io/component: metrics`, port
  `metrics`) through its EndpointSlices, as a ServiceMonitor does, on a real node. On the
  process node the Service has no endpoints (the API server refuses the pods' loopback IPs in an
  EndpointSlice), so there the same pods are found by their labels and container port
  `metrics`, the port the Service targets, as a PodMonitor does. Either way the targets are
  labelled as the Prometheus Operator labels a ServiceMonitor's (job = the Service's name,
  namespace, pod, container, service, endpoint): the dashboard reads the same series;
- the workers: every worker pod (`app.kubernetes.io/name: weightlift-worker`) on its container
  port `http`, where the worker serves /metrics, labelled as the chart's PodMonitor labels
  them (`deployment`, `replica`).
On the process node a pod's IP is a 127.0.x.y address of the host's loopback, so the
discovered targets are reached as they are. An operator run as a local process (`install
process`) is no pod: it is scraped at its loopback port, under a static job.
"""

from __future__ import annotations

import base64
import contextlib
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightlift.api.labels import DEPLOYMENT_LABEL, REPLICA_LABEL, WORKER_LABELS
from weightlift.local import prometheus_pod
from weightlift.local.cluster import cached_binary
from weightlift.local.kube import JSON, KUBE_ERRORS, Kube, call
from weightlift.local.net import free_port
from weightlift.local.procs import UpDown, child_options, stop_group

# Pinned; hack/build-prometheus.sh carries the same value.
PROMETHEUS_VERSION = "v3.16.0"
NAMESPACE = "monitoring"
ACCOUNT = "prometheus"
# Scrape every second: a demo deployment is Ready in seconds.
SCRAPE_INTERVAL = "1s"
OPERATOR_JOB = "weightlift-operator"  # a process operator (no Service): the static job's name
WORKER_JOB = "weightlift-worker"
# A day: `demo --prometheus` may be left running for hours (a TokenRequest's default is 1 h).
TOKEN_SECONDS = 24 * 3600
# What Kubernetes service discovery reads (Prometheus' docs list the same), namespace by
# namespace.
SD_RULES = [
    {"apiGroups": [""], "resources": ["pods", "services", "endpoints"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["get", "list", "watch"]},
]  # fmt: skip


class PrometheusError(RuntimeError):
    """Prometheus is not built, did not come up, or a query failed."""


def prometheus_path(cache: Path | None = None) -> Path:
    return cached_binary("prometheus", PROMETHEUS_VERSION, PrometheusError, cache)


def _meta(label: str) -> str:
    """A Kubernetes label's service-discovery meta label (`.`, `/`, `-` become `_`)."""
    clean = "".join(c if c.isalnum() else "_" for c in label)
    return f"__meta_kubernetes_pod_label_{clean}"


# As the chart's PodMonitor labels worker targets: the pod's ModelDeployment and replica index,
# the labels the worker puts on its engine's series too, whose scraped copies go.
WORKER_TARGET_LABELS = [
    {"source_labels": [_meta(DEPLOYMENT_LABEL)], "target_label": "deployment"},
    {"source_labels": [_meta(REPLICA_LABEL)], "target_label": "replica"},
]
WORKER_EXPORTED_DROP = {"action": "labeldrop", "regex": "exported_(deployment|replica)"}


def _sd(role: str, namespaces: list[str], server: str | None, auth: JSON) -> list[JSON]:
    """Service discovery of `role`; without `server`, in-cluster (the pod's ServiceAccount)."""
    where = {"api_server": server, **auth} if server is not None else {}
    return [{"role": role, "namespaces": {"names": namespaces}, **where}]


def _target_labels(prefix: str) -> list[JSON]:
    """namespace, pod, container: what dashboards group by (`sum by (pod)`)."""
    return [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": [f"{prefix}container_name"], "target_label": "container"},
    ]


@dataclass(frozen=True)
class ChartOperator:
    """Where the chart's operator pods are and how to find them: `via` "endpointslice" (the
    metrics Service's endpoints, as a ServiceMonitor) or "pod" (the pods' container port
    `metrics` that the Service targets, as a PodMonitor). The process node needs "pod": its pod
    IPs are loopback addresses, which the API server refuses in an EndpointSlice, so the
    metrics Service has no endpoints there."""

    namespace: str
    release: str  # the pods' app.kubernetes.io/instance
    service: str  # the metrics Service's name: every target's job, as a ServiceMonitor's
    via: Literal["endpointslice", "pod"] = "endpointslice"
    port: str = "metrics"


def _operator_job(op: ChartOperator, server: str | None, auth: JSON) -> JSON:
    if op.via == "endpointslice":
        keep = {
            "__meta_kubernetes_service_label_app_kubernetes_io_name": "weightlift",
            "__meta_kubernetes_service_label_app_kubernetes_io_instance": op.release,
            "__meta_kubernetes_service_label_app_kubernetes_io_component": "metrics",
            "__meta_kubernetes_endpointslice_port_name": op.port,
        }
    else:
        keep = {
            _meta("app.kubernetes.io/name"): "weightlift",
            _meta("app.kubernetes.io/instance"): op.release,
            "__meta_kubernetes_pod_container_port_name": op.port,
        }
    return {
        "job_name": f"{op.service}-{op.via}",
        "kubernetes_sd_configs": _sd(op.via, [op.namespace], server, auth),
        "relabel_configs": [
            {
                "action": "keep",
                "source_labels": list(keep),
                "regex": ";".join(re.escape(v) for v in keep.values()),
            },
            *_target_labels("__meta_kubernetes_pod_"),
            {"target_label": "service", "replacement": op.service},
            {"target_label": "job", "replacement": op.service},
            {"target_label": "endpoint", "replacement": op.port},
        ],
    }


def scrape_config(
    *,
    server: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    operator: ChartOperator | None,
    worker_namespaces: list[str],
    operator_target: str | None = None,
    interval: str = SCRAPE_INTERVAL,
) -> JSON:
    """prometheus.yml: the chart's operator pods (`operator`; or `operator_target`, host:port,
    for an operator run as a local process) and the worker pods. `server` None: Prometheus runs
    as a pod and discovers in-cluster (no token or CA file of ours)."""
    auth = {
        "authorization": {"credentials_file": str(token_file)},
        "tls_config": {"ca_file": str(ca_file)},
    }
    jobs: list[JSON] = []
    if operator is not None:
        jobs.append(_operator_job(operator, server, auth))
    if operator_target is not None:
        jobs.append({"job_name": OPERATOR_JOB, "static_configs": [{"targets": [operator_target]}]})
    keep = [_meta(k) for k in WORKER_LABELS]
    jobs.append(
        {
            "job_name": WORKER_JOB,
            "kubernetes_sd_configs": _sd("pod", worker_namespaces, server, auth),
            "relabel_configs": [
                {
                    "action": "keep",
                    "source_labels": [*keep, "__meta_kubernetes_pod_container_port_name"],
                    "regex": ";".join([*WORKER_LABELS.values(), "http"]),
                },
                # A finished pod's IP may be another pod's already.
                {
                    "action": "drop",
                    "source_labels": ["__meta_kubernetes_pod_phase"],
                    "regex": "Succeeded|Failed",
                },
                *_target_labels("__meta_kubernetes_pod_"),
                *WORKER_TARGET_LABELS,
            ],
            "metric_relabel_configs": [WORKER_EXPORTED_DROP],
        }
    )
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": jobs,
    }


@dataclass
class LocalPrometheus(UpDown):
    """Prometheus on 127.0.0.1:<free port> scraping a LocalStack (`stack`: its kubeconfig, its
    release or process operator, its namespace). Everything it made (the process, its data,
    its ServiceAccount and RBAC) goes in `down()`.

    >>> with LocalPrometheus(stack, state_dir / "prometheus") as prom:
    ...     prom.query("sum(weightlift_replica_time_to_ready_seconds_count)")
    """

    stack: Any  # a LocalStack (not imported: stack.py stays free of this module)
    state_dir: Path
    interval: str = SCRAPE_INTERVAL
    port: int = field(init=False, default=0)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    pod_ip: str | None = field(init=False, default=None)  # on the kubelet node: a pod
    _kube: Kube | None = field(init=False, default=None)
    _bound: list[str] = field(init=False, default_factory=list)  # namespaces with a RoleBinding

    @property
    def in_pod(self) -> bool:
        """On the real node pods have network namespaces of their own: Prometheus is one of
        them (local/prometheus_pod.py), as in a cluster. On the process node, a host process."""
        return bool(self.stack.node_kind == "kubelet")

    @property
    def url(self) -> str:
        if self.pod_ip is not None:
            return f"http://{self.pod_ip}:{prometheus_pod.PORT}"
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        if self.pod_ip is not None:
            logs = self.stack.node.pod_logs(NAMESPACE, prometheus_pod.POD)
            if logs:
                return Path(logs[-1])
        return self.state_dir / "prometheus.log"

    # -- up
    def up(self, timeout: float = 60.0) -> None:
        exe = prometheus_path()
        self.state_dir = Path(self.state_dir).resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._kube = Kube(self.stack.kubeconfig, "prometheus-setup")
        release = self.stack.release
        if self.in_pod and release is None:
            raise PrometheusError(
                "on the kubelet node Prometheus runs as a pod and scrapes the chart's operator "
                "pods: install the operator with helm (`--install helm`)"
            )
        operator = None
        if release is not None:
            operator = ChartOperator(
                namespace=release.namespace,
                release=release.name,
                service=f"{release.fullname}-metrics",
                via="pod" if self.stack.node_kind == "process" else "endpointslice",
            )
        worker_ns = [self.stack.namespace]
        token = self._account([*worker_ns, *([release.namespace] if release else [])])
        if self.in_pod:
            config = scrape_config(
                server=None,
                token_file=None,
                ca_file=None,
                operator=operator,
                worker_namespaces=worker_ns,
                interval=self.interval,
            )
            self._start_pod(exe, config, timeout)
            return
        token_file = self.state_dir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        operator_target = None
        if release is None:
            url = self.stack.operator_metrics_url()
            operator_target = url.split("//", 1)[1].split("/", 1)[0] if url else None
        config = scrape_config(
            server=self._kube.server,
            token_file=token_file,
            ca_file=self._ca_file(),
            operator=operator,
            worker_namespaces=worker_ns,
            operator_target=operator_target,
            interval=self.interval,
        )
        config_file = self.state_dir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        argv = [
            str(exe),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.state_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
        ]
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen(argv, **child_options(log, die_with=signal.SIGTERM))
        self._wait_ready(timeout)

    def _start_pod(self, exe: Path, config: JSON, timeout: float) -> None:
        """The image of the same binary, pushed to the node's registry, run as a pod."""
        assert self._kube is not None
        image = prometheus_pod.ensure_image(exe, PROMETHEUS_VERSION)
        self.stack.node.push_images([image])
        configmap, pod = prometheus_pod.manifests(
            NAMESPACE, ACCOUNT, self.stack.node.registry_ref(image), config
        )
        (self.state_dir / "prometheus.yml").write_text(configmap["data"]["prometheus.yml"])
        try:
            self.pod_ip = prometheus_pod.start(self._kube, NAMESPACE, configmap, pod, timeout)
        except prometheus_pod.PodPrometheusError as exc:
            raise PrometheusError(str(exc)) from exc
        self._wait_ready(timeout)

    def _ca_file(self) -> Path:
        """The API server's CA, as the stack's kubeconfig carries it."""
        kubeconfig = yaml.safe_load(Path(self.stack.kubeconfig).read_text())
        cluster = kubeconfig["clusters"][0]["cluster"]
        path = self.state_dir / "ca.crt"
        if "certificate-authority-data" in cluster:
            path.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
        else:
            path.write_bytes(Path(cluster["certificate-authority"]).read_bytes())
        return path

    def _account(self, namespaces: list[str]) -> str:
        """The ServiceAccount, its read access in each namespace, and a token for it."""
        assert self._kube is not None
        core, rbac = self._kube.core, client.RbacAuthorizationV1Api(self._kube.api)
        _create(core.create_namespace, {"metadata": {"name": NAMESPACE}})
        _create(
            core.create_namespaced_service_account,
            NAMESPACE,
            {"metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
        )
        role = f"{NAMESPACE}-{ACCOUNT}-sd"
        _create(rbac.create_cluster_role, {"metadata": {"name": role}, "rules": SD_RULES})
        for ns in dict.fromkeys(namespaces):
            binding = {
                "metadata": {"name": role, "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
            }  # fmt: skip
            _create(core.create_namespace, {"metadata": {"name": ns}})
            _create(rbac.create_namespaced_role_binding, ns, binding)
            self._bound.append(ns)
        request = {"spec": {"expirationSeconds": TOKEN_SECONDS}}
        answer = call(core.create_namespaced_service_account_token, ACCOUNT, NAMESPACE, request)
        return str(answer["status"]["token"])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no prometheus log)"

    # -- down
    def down(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=10.0)
            self.proc = None
        if self._kube is not None and self.pod_ip is not None:
            with contextlib.suppress(*KUBE_ERRORS):  # the API server went down first
                prometheus_pod.stop(self._kube, NAMESPACE)
            self.pod_ip = None
        if self._kube is not None:
            self._remove_account()
            self._kube.close()
            self._kube = None

    def _remove_account(self) -> None:
        """What `_account` made, but the namespaces (others may use them). The API server may
        be gone already (the stack went down first): nothing left to remove then."""
        assert self._kube is not None
        core, rbac = self._kube.core, client.RbacAuthorizationV1Api(self._kube.api)
        role = f"{NAMESPACE}-{ACCOUNT}-sd"
        try:
            for ns in self._bound:
                _delete(rbac.delete_namespaced_role_binding, role, ns)
            _delete(rbac.delete_cluster_role, role)
            _delete(core.delete_namespaced_service_account, ACCOUNT, NAMESPACE)
        except KUBE_ERRORS:  # best effort: the API server went down first
            pass
        self._bound.clear()

    # -- the HTTP API
    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; its `data`, or PrometheusError with Prometheus' own error."""
        try:
            res = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
            body = res.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"GET /api/v1/{path}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[JSON]:
        """An instant query's result vector (each: `metric` labels, `value` [t, "v"])."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = at
        data = self.api("query", **params)
        result: list[JSON] = data["result"]
        return result

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[JSON]:
        """A range query's matrix (each: `metric` labels, `values` [[t, "v"], ...])."""
        data = self.api("query_range", query=promql, start=start, end=end, step=step)
        result: list[JSON] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        """Grafana's `label_values(match, label)`: the label's values on series of `match`."""
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": match})
        return values

    def targets(self) -> list[JSON]:
        """The active scrape targets (labels, health, lastError)."""
        active: list[JSON] = self.api("targets", state="active")["activeTargets"]
        return active


def _create(method: Any, *args: Any) -> None:
    try:
        call(method, *args)
    except ApiException as exc:
        if exc.status != 409:  # it exists: a second Prometheus on the stack shares it
            raise


def _delete(method: Any, *args: Any) -> None:
    try:
        call(method, *args)
    except ApiException as exc:
        if exc.status != 404:
            raise
