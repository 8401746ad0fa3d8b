"""The local Prometheus: hack/build-prometheus.sh builds the version local/prometheus.py looks
for, and its scrape config keeps what the chart and the operator ship (the chart's metrics
Service as helm renders it; the worker pods' labels and port), nothing else."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml

from tests.unit.operator.test_chart import by_kind, helm, template
from weightlift.api.labels import WORKER_LABELS
from weightlift.local import prometheus_pod
from weightlift.local.prometheus import (
    PROMETHEUS_VERSION,
    WORKER_JOB,
    ChartOperator,
    scrape_config,
)

__all__ = ["helm"]  # the fixture
REPO = Path(__file__).resolve().parents[3]
JSON = dict[str, Any]


def test_build_script_and_launcher_pin_the_same_prometheus() -> None:
    script = (REPO / "hack" / "build-prometheus.sh").read_text()
    pinned = re.search(r'^PROMETHEUS_VERSION="([^"]+)"', script, re.M)
    module = re.search(r'^PROMETHEUS_MODULE_VERSION="([^"]+)"', script, re.M)
    assert pinned is not None and module is not None
    assert pinned.group(1) == PROMETHEUS_VERSION
    # Prometheus 3.M.P is published to the Go proxy as module version v0.3MM.P.
    major, minor, patch = PROMETHEUS_VERSION.lstrip("v").split(".")
    assert module.group(1) == f"v0.{major}{int(minor):02d}.{patch}"


def _config(via: Literal["endpointslice", "pod"] = "pod") -> JSON:
    operator = ChartOperator("weightlift", "wl", "wl-operator-metrics", via=via)
    return scrape_config(
        server="https://127.0.0.1:6443",
        token_file=Path("/s/token"),
        ca_file=Path("/s/ca.crt"),
        operator=operator,
        worker_namespaces=["default"],
    )


def _kept(job: JSON, meta: dict[str, str]) -> bool:
    """Prometheus' `keep` relabelling of a target with these meta labels (missing: empty)."""
    for rule in job["relabel_configs"]:
        if rule.get("action") == "keep":
            joined = ";".join(meta.get(label, "") for label in rule["source_labels"])
            if not re.fullmatch(rule["regex"], joined):
                return False
    return True


def _job(config: JSON, name: str) -> JSON:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return job


def _labels(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    """Kubernetes labels as service discovery's meta labels."""
    return {prefix + re.sub(r"[^a-zA-Z0-9]", "_", k): v for k, v in labels.items()}


def _fixed_labels(job: JSON) -> dict[str, str]:
    """The target labels a job sets to a fixed value (no source labels)."""
    return {
        r["target_label"]: r["replacement"]
        for r in job["relabel_configs"]
        if "target_label" in r and not r.get("source_labels")
    }


def test_the_operator_job_keeps_the_charts_metrics_service_only(helm: Path) -> None:
    """Through EndpointSlices (a real node): the metrics Service's port `metrics`, no other."""
    docs = template(helm)
    job = _job(_config("endpointslice"), "wl-operator-metrics-endpointslice")
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "endpointslice" and sd["namespaces"] == {"names": ["weightlift"]}
    assert sd["authorization"] == {"credentials_file": "/s/token"}
    assert sd["tls_config"] == {"ca_file": "/s/ca.crt"}
    kept = [
        (s["metadata"]["name"], p["name"])
        for s in by_kind(docs, "Service")
        for p in s["spec"]["ports"]
        if _kept(
            job,
            {
                **_labels("__meta_kubernetes_service_label_", s["metadata"]["labels"]),
                "__meta_kubernetes_endpointslice_port_name": p["name"],
            },
        )
    ]
    assert kept == [("wl-operator-metrics", "metrics")]
    # The job is the Service's name (as a ServiceMonitor's targets): the dashboard's $job.
    assert _fixed_labels(job)["job"] == "wl-operator-metrics"


def test_on_the_process_node_the_operator_pods_are_found_by_the_services_target_port(
    helm: Path,
) -> None:
    """Through pods (the process node): the container port the metrics Service targets, on the
    pods it selects; labelled as the Service's targets would be."""
    docs = template(helm)
    job = _job(_config("pod"), "wl-operator-metrics-pod")
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("metrics")]
    (deployment,) = by_kind(docs, "Deployment")
    template_ = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template_["metadata"]["labels"].items()
    pod_meta = _labels("__meta_kubernetes_pod_label_", template_["metadata"]["labels"])
    kept = [
        p["name"]
        for c in template_["spec"]["containers"]
        for p in c["ports"]
        if _kept(job, {**pod_meta, "__meta_kubernetes_pod_container_port_name": p["name"]})
    ]
    assert kept == [service["spec"]["ports"][0]["targetPort"]] == ["metrics"]
    other = _labels("__meta_kubernetes_pod_label_", {"app.kubernetes.io/name": "weightlift"})
    assert not _kept(job, {**other, "__meta_kubernetes_pod_container_port_name": "metrics"})
    assert _fixed_labels(job) == {
        "job": "wl-operator-metrics",
        "service": "wl-operator-metrics",
        "endpoint": "metrics",
    }


def test_the_worker_job_keeps_worker_pods_on_their_http_port() -> None:
    job = _job(_config(), WORKER_JOB)
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"] == {"names": ["default"]}
    pod_meta = _labels("__meta_kubernetes_pod_label_", WORKER_LABELS)
    port = "__meta_kubernetes_pod_container_port_name"
    assert _kept(job, {**pod_meta, port: "http"})
    assert not _kept(job, {**pod_meta, port: "triton-metrics"})  # the worker re-exports it
    assert not _kept(job, {port: "http"})  # any other pod
    dropped = [r for r in job["relabel_configs"] if r.get("action") == "drop"]
    assert dropped and re.fullmatch(dropped[0]["regex"], "Succeeded")


def test_the_worker_job_labels_targets_and_series_as_the_charts_pod_monitor(helm: Path) -> None:
    """The same selection, target labels and metric relabelling as the PodMonitor the chart
    ships (`metrics.podMonitor`), written as prometheus.yml spells them."""
    (monitor,) = by_kind(template(helm, "--set", "metrics.podMonitor.enabled=true"), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    job = _job(_config(), WORKER_JOB)
    pod_meta = _labels("__meta_kubernetes_pod_label_", monitor["spec"]["selector"]["matchLabels"])
    assert _kept(job, {**pod_meta, "__meta_kubernetes_pod_container_port_name": endpoint["port"]})
    relabeled = {
        r["target_label"]: r["source_labels"]
        for r in job["relabel_configs"]
        if r.get("target_label") in ("deployment", "replica")
    }
    assert relabeled == {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert job["metric_relabel_configs"] == endpoint["metricRelabelings"]


def test_a_process_operator_is_a_static_target() -> None:
    config = scrape_config(
        server="https://127.0.0.1:6443",
        token_file=Path("/s/token"),
        ca_file=Path("/s/ca.crt"),
        operator=None,
        worker_namespaces=["default"],
        operator_target="127.0.0.1:9400",
    )
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"weightlift-operator", WORKER_JOB}
    assert jobs["weightlift-operator"]["static_configs"] == [{"targets": ["127.0.0.1:9400"]}]
    assert config["global"]["scrape_interval"] == config["global"]["scrape_timeout"] == "1s"


def test_as_a_pod_it_discovers_in_cluster_and_runs_locked_down() -> None:
    """On the real node: no API server address, token or CA of ours in prometheus.yml (the
    pod's ServiceAccount, in-cluster); the pod is non-root with a read-only root filesystem."""
    operator = ChartOperator("weightlift", "wl", "wl-operator-metrics", via="endpointslice")
    config = scrape_config(
        server=None, token_file=None, ca_file=None, operator=operator, worker_namespaces=["ns"]
    )
    for job in config["scrape_configs"]:
        for sd in job["kubernetes_sd_configs"]:
            assert set(sd) == {"role", "namespaces"}, sd
    configmap, pod = prometheus_pod.manifests("monitoring", "prometheus", "reg/p:v1", config)
    assert yaml.safe_load(configmap["data"]["prometheus.yml"]) == config
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "prometheus" and spec["automountServiceAccountToken"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
    (container,) = spec["containers"]
    assert container["image"] == "reg/p:v1"
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in container["args"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/etc/prometheus": "config", "/prometheus": "data"}
