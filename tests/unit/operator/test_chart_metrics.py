"""The chart's metrics parts, rendered by the real helm binary: the operator's metrics port and
Service, the optional ServiceMonitor, the workers' optional PodMonitor and the Grafana
dashboard, and the NetworkPolicy's metricsFrom. The dashboard's queries name only families the
operator and vLLM 0.32 really export."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.support.vllm_metrics import exposition
from tests.unit.operator.test_chart import CHART, by_kind, helm, template
from tests.unit.operator.test_pods import container, make_spec, render
from weightlift.api.labels import DEPLOYMENT_LABEL, REPLICA_LABEL
from weightlift.operator.metrics import Metrics
from weightlift.operator.settings import METRICS_HOST_ENV, METRICS_PORT_ENV
from weightlift.worker.engines.exposition import replica_labels

__all__ = ["helm"]  # the fixture, shared with test_chart.py


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_metrics_port_and_service_by_default_and_nothing_optional(helm: Path) -> None:
    docs = template(helm)
    container = _container(docs)
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert {"name": METRICS_PORT_ENV, "value": "8081"} in container["env"]
    env = [e["name"] for e in container["env"]]
    # Bound to the pod's address (POD_IP comes first: $(POD_IP) expands only earlier vars).
    assert {"name": METRICS_HOST_ENV, "value": "$(POD_IP)"} in container["env"]
    assert env.index("POD_IP") < env.index(METRICS_HOST_ENV)
    services = by_kind(docs, "Service")
    (service,) = services
    assert service["metadata"]["name"] == "wl-operator-metrics"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}
    ]
    (deployment,) = by_kind(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert by_kind(docs, "ServiceMonitor") == []
    assert by_kind(docs, "PodMonitor") == []
    assert [c for c in by_kind(docs, "ConfigMap") if "dashboard" in c["metadata"]["name"]] == []


def test_metrics_can_be_turned_off(helm: Path) -> None:
    docs = template(helm, "--set", "metrics.enabled=false")
    container = _container(docs)
    assert all(p["name"] != "metrics" for p in container["ports"])
    assert all(e["name"] != METRICS_PORT_ENV for e in container["env"])
    assert by_kind(docs, "Service") == []
    on_but_off = template(
        helm, "--set", "metrics.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"
    )
    assert by_kind(on_but_off, "ServiceMonitor") == []


def test_service_monitor_scrapes_the_metrics_service(helm: Path) -> None:
    docs = template(
        helm,
        "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.serviceMonitor.interval=15s",
        "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
        "--set", "metrics.port=9400",
    )  # fmt: skip
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = by_kind(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["weightlift"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert service["spec"]["ports"][0]["port"] == 9400
    assert {"name": "metrics", "containerPort": 9400} in _container(docs)["ports"]


def _meta_label(label: str) -> str:
    """A pod label as Kubernetes service discovery names it."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def test_pod_monitor_scrapes_the_workers_http_port_labelled_as_the_worker_labels(
    helm: Path,
) -> None:
    docs = template(
        helm,
        "--set", "metrics.podMonitor.enabled=true",
        "--set", "metrics.podMonitor.interval=15s",
        "--set", "metrics.podMonitor.scrapeTimeout=10s",
        "--set", "metrics.podMonitor.labels.release=kube-prometheus-stack",
        "--set-json", 'workerNamespaces=["models","batch"]',
        # Its own switch: the workers serve /metrics whatever the operator's metrics say.
        "--set", "metrics.enabled=false",
    )  # fmt: skip
    (monitor,) = by_kind(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "weightlift"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["models", "batch"]}
    # It selects the pods the operator renders (a vLLM replica's), on their worker port.
    spec = make_spec(
        model={"uri": "hostpath:///models/llama", "format": "safetensors"},
        runtime={"engine": "vLLM"},
    )
    pod = render(spec)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "10s")
    (port,) = [p for p in container(pod)["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == spec.runtime.port  # where the worker serves /metrics
    # Targets labelled with the pod's deployment and replica, by the names the worker gives
    # its engine's series, whose scraped copies (exported_*) go.
    relabeled = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabeled == {
        "deployment": [_meta_label(DEPLOYMENT_LABEL)],
        "replica": [_meta_label(REPLICA_LABEL)],
    }
    assert set(relabeled) == set(replica_labels("x", 0))
    pod_labels = pod["metadata"]["labels"]
    assert (pod_labels[DEPLOYMENT_LABEL], pod_labels[REPLICA_LABEL]) == ("llama", "0")
    (drop,) = endpoint["metricRelabelings"]
    assert drop["action"] == "labeldrop"
    assert re.fullmatch(drop["regex"], "exported_deployment")
    assert re.fullmatch(drop["regex"], "exported_replica")
    assert not re.fullmatch(drop["regex"], "deployment")
    # The release namespace by default (workerNamespaces empty, the whole cluster watched).
    (default,) = by_kind(template(helm, "--set", "metrics.podMonitor.enabled=true"), "PodMonitor")
    assert default["spec"]["namespaceSelector"] == {"matchNames": ["weightlift"]}
    assert "scrapeTimeout" not in default["spec"]["podMetricsEndpoints"][0]


def _dashboard(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (configmap,) = [c for c in by_kind(docs, "ConfigMap") if "dashboard" in c["metadata"]["name"]]
    (key,) = configmap["data"]
    return configmap, json.loads(configmap["data"][key])


def test_dashboard_configmap_carries_the_grafana_sidecar_label(helm: Path) -> None:
    docs = template(helm, "--set", "metrics.dashboard.enabled=true")
    configmap, dashboard = _dashboard(docs)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "weightlift"
    assert dashboard["uid"] == "weightlift-operator" and len(dashboard["panels"]) >= 10
    moved = template(
        helm,
        "--set",
        "metrics.dashboard.enabled=true",
        "--set",
        "metrics.dashboard.namespace=monitoring",
    )
    assert _dashboard(moved)[0]["metadata"]["namespace"] == "monitoring"


def test_every_dashboard_query_names_families_the_operator_exports(helm: Path) -> None:
    _, dashboard = _dashboard(template(helm, "--set", "metrics.dashboard.enabled=true"))
    metrics = Metrics(CollectorRegistry())
    samples = {
        sample.name for family in metrics.registry.collect() for sample in family.samples
    } | {family.name for family in metrics.registry.collect()}
    # Families with labels have no samples until observed: their series names by type.
    for family in metrics.registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        samples |= {family.name + s for s in suffixes.get(family.type, [])}
    # vLLM's series (the workers re-export them): what vLLM 0.32's own stat logger writes.
    vllm_samples = {
        sample.name
        for family in text_string_to_metric_families(exposition())
        for sample in family.samples
        if sample.name.startswith("vllm:")
    }
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\b((?:weightlift|process)_[a-z_]+)\b", expr))
        vllm_names = set(re.findall(r"(?<![\w:])(vllm:[a-z_:]+)\b", expr))
        assert names or vllm_names, expr
        used |= names | vllm_names
        assert names <= samples, f"{expr}: {names - samples} not exported"
        assert vllm_names <= vllm_samples, f"{expr}: {vllm_names - vllm_samples} not in vLLM 0.32"
        # Only the series weightlift's workers labelled (any other vLLM the cluster scrapes: not).
        assert not vllm_names or 'deployment!=""' in expr, expr
    wanted = {
        "weightlift_replicas",
        "weightlift_replica_time_to_ready_seconds_bucket",
        "weightlift_standby_wait_seconds_bucket",
        "weightlift_handoff_latency_seconds_bucket",
        "weightlift_storage_fallbacks_total",
        "weightlift_compile_cache_total",
        "weightlift_probe_failures_total",
        "weightlift_reconcile_total",
        "weightlift_reconcile_duration_seconds_bucket",
        "weightlift_api_requests_total",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
    }
    assert wanted <= used, wanted - used


def test_network_policy_lets_metrics_from_scrape_the_workers(helm: Path) -> None:
    scrapers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    docs = template(
        helm,
        "--set", "networkPolicy.enabled=true",
        "--set-json", f"networkPolicy.metricsFrom={json.dumps(scrapers)}",
        "--set-json", "networkPolicy.servingPorts=[8000,8001]",
    )  # fmt: skip
    (policy,) = by_kind(docs, "NetworkPolicy")
    _peers, metrics = policy["spec"]["ingress"]  # no servingFrom given: peers, then scrapers
    assert metrics["from"] == scrapers
    assert metrics["ports"] == [
        {"protocol": "TCP", "port": 8000},
        {"protocol": "TCP", "port": 8001},
    ]
    (alone,) = by_kind(template(helm, "--set", "networkPolicy.enabled=true"), "NetworkPolicy")
    assert len(alone["spec"]["ingress"]) == 1  # no metricsFrom: no rule for it


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("metrics.port=80", "/metrics/port"),
        ("metrics.serviceMonitor.interval=soon", "/metrics/serviceMonitor/interval"),
        ("metrics.podMonitor.interval=soon", "/metrics/podMonitor/interval"),
        ("metrics.podMonitor.scrape=yes", "/metrics/podMonitor"),
        ("metrics.dashboard.namespace=Not_A_Namespace", "/metrics/dashboard/namespace"),
        ("metrics.scrape=yes", "/metrics"),
    ],
)
def test_values_schema_rejects_bad_metrics_values(helm: Path, setting: str, key: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", setting],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f"at '{key}'" in result.stderr, result.stderr
