"""The chart's metrics parts, rendered by the real helm binary: the operator's metrics port and
Service, the optional ServiceMonitor and Grafana dashboard, and the NetworkPolicy's
metricsFrom. The dashboard's queries name only families the operator really exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.unit.operator.test_chart import CHART, by_kind, helm, template
from weightlift.operator.metrics import Metrics
from weightlift.operator.settings import METRICS_HOST_ENV, METRICS_PORT_ENV

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
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\b((?:weightlift|process)_[a-z_]+)\b", expr))
        assert names, expr
        used |= names
        assert names <= samples, f"{expr}: {names - samples} not exported"
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
