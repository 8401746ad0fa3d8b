"""The operator's metrics: bounded labels, the API request counters on both clients (the real
kubernetes client and kopf's aiohttp session, against a loopback HTTP server), the gauges'
arithmetic and /metrics as Prometheus reads it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import urllib3
from aiohttp import web
from kopf._cogs.clients import auth
from kopf._cogs.structs import credentials
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from weightlift.operator import apicalls, kube
from weightlift.operator.metrics import (
    COMPILE_CACHE_OUTCOMES,
    ENGINES,
    FALLBACK_REASONS,
    HANDED,
    METRICS,
    OTHER,
    Metrics,
    compile_cache_label,
    loaded_from_label,
    serve,
)
from weightlift.operator.settings import METRICS_HOST_ENV, METRICS_PORT_ENV, Settings


def fresh() -> Metrics:
    return Metrics(CollectorRegistry(), process=False)


def value(m: Metrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


@pytest.mark.parametrize(
    ("method", "url", "expected"),
    [
        ("GET", "https://h/api/v1/namespaces/ns/pods?labelSelector=a%3Db", ("list", "pods")),
        ("GET", "https://h/api/v1/namespaces/ns/pods?watch=true&rv=1", ("watch", "pods")),
        ("GET", "https://h/api/v1/watch/namespaces/ns/pods", ("watch", "pods")),
        ("GET", "https://h/api/v1/namespaces/ns/pods/llama-abc-0", ("get", "pods")),
        ("POST", "https://h/api/v1/namespaces/ns/pods", ("create", "pods")),
        ("DELETE", "https://h/api/v1/namespaces/ns/pods/p", ("delete", "pods")),
        (
            "DELETE",
            "https://h/api/v1/namespaces/ns/configmaps?x=1",
            ("deletecollection", "configmaps"),
        ),
        (
            "PATCH",
            "https://h/apis/weightlift.dev/v1alpha1/namespaces/ns/modeldeployments/m/status",
            ("patch", "modeldeployments/status"),
        ),
        (
            "PUT",
            "https://h/apis/coordination.k8s.io/v1/namespaces/ns/leases/l",
            ("update", "leases"),
        ),
        ("GET", "https://h/api/v1/nodes", ("list", "nodes")),
        ("GET", "https://h/api/v1/namespaces/ns", ("get", "namespaces")),
        ("GET", "https://h/api/v1/namespaces", ("list", "namespaces")),
        ("GET", "https://h/apis/weightlift.dev/v1alpha1", ("get", "nonresource")),
        ("GET", "https://h/version", ("get", "nonresource")),
        ("GET", "https://h/api/v1/namespaces/ns/Weird_Name", ("list", "other")),
    ],
)
def test_requests_are_named_as_the_api_servers_audit_log_names_them(
    method: str, url: str, expected: tuple[str, str]
) -> None:
    assert apicalls.classify(method, url) == expected


def test_label_values_come_from_fixed_sets() -> None:
    assert loaded_from_label("peer:llama-abc-0") == "peer"  # no pod names
    assert loaded_from_label("storage:s3") == "storage:s3"
    assert loaded_from_label("storage:gopher") == "storage:other"
    assert loaded_from_label("cache") == "cache"
    assert loaded_from_label(None) == "unknown"
    assert loaded_from_label("anything at all") == "other"
    assert loaded_from_label("peer:a-0,peer:a-1") == "peer"  # one per rank
    assert loaded_from_label("peer:a-0,storage:s3") == "mixed"
    assert compile_cache_label("hit", "peer:p") == "hit_peer"
    assert compile_cache_label("hit (peer)", "peer:p") == "hit_peer"
    assert compile_cache_label("hit (store)", "peer:p") == "hit_store"
    assert compile_cache_label("hit (store)", "storage:s3") == "hit_store"
    assert compile_cache_label("hit", "storage:s3") == "hit_store"
    assert compile_cache_label("miss (vLLM's cache key differs: abc from p)", "peer:p") == "miss"
    assert compile_cache_label("none", None) == "none"
    assert compile_cache_label("", None) == "none"
    assert compile_cache_label("something new", None) in COMPILE_CACHE_OUTCOMES
    m = fresh()
    m.fallback("a reason nobody planned for")
    m.probed("SomeEngine", passed=False)
    assert value(m, "weightlift_storage_fallbacks_total", reason="other") == 1
    assert value(m, "weightlift_probe_failures_total", engine="other") == 1


def test_series_of_a_fixed_vocabulary_start_at_zero() -> None:
    """A dashboard's fallback, probe-failure or hand-off panel says 0 before the first one (or
    shows the first ones), not "no data": get_sample_value answers None for a series that does
    not exist."""
    m = fresh()
    sample = m.registry.get_sample_value
    for reason in FALLBACK_REASONS:
        assert sample("weightlift_storage_fallbacks_total", {"reason": reason}) == 0
    for engine in ENGINES:
        for name in ("weightlift_probes_total", "weightlift_probe_failures_total"):
            assert sample(name, {"engine": engine}) == 0
    for handed in HANDED:
        for name in ("weightlift_standby_wait_seconds", "weightlift_handoff_latency_seconds"):
            assert sample(f"{name}_count", {"handed": handed}) == 0
    assert sample("weightlift_storage_fallbacks_total", {"reason": OTHER}) is None


def test_phase_gauges_follow_each_deployments_last_count() -> None:
    m = fresh()
    m.count_phases("a", {"Loading": 2, "Standby": 1}, "Loading")
    m.count_phases("b", {"Ready": 2}, "Ready")
    m.count_phases("a", {"Ready": 3}, "Ready")
    assert value(m, "weightlift_replicas", phase="Ready") == 5
    assert value(m, "weightlift_replicas", phase="Loading") == 0
    assert value(m, "weightlift_replicas", phase="Standby") == 0
    assert value(m, "weightlift_deployments", phase="Ready") == 2
    assert value(m, "weightlift_deployments", phase="Loading") == 0
    m.count_phases("b", {"Bogus": 1}, "Bogus")
    assert value(m, "weightlift_replicas", phase="other") == 1
    m.forget("a")
    m.forget("b")
    m.forget("never seen")
    for phase in ("Ready", "other"):
        assert value(m, "weightlift_replicas", phase=phase) == 0
        assert value(m, "weightlift_deployments", phase=phase) == 0


def test_reconcile_families_are_controller_runtimes() -> None:
    m = fresh()
    m.reconciled(0.02, ok=True)
    m.reconciled(0.3, ok=False)
    c = {"controller": "modeldeployment"}
    assert value(m, "weightlift_reconcile_total", **c, result="success") == 1
    assert value(m, "weightlift_reconcile_total", **c, result="error") == 1
    assert value(m, "weightlift_reconcile_errors_total", **c) == 1
    assert value(m, "weightlift_reconcile_duration_seconds_count", **c) == 2
    assert value(m, "weightlift_reconcile_duration_seconds_bucket", **c, le="0.025") == 1


# --------------------------------------------------------------------- the kubernetes client
class _ApiServer(BaseHTTPRequestHandler):
    """Lists answer 200, the first patch 429, later ones 200."""

    patches = 0

    def log_message(self, *_: Any) -> None:
        pass

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200, {"kind": "PodList", "items": []})

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).patches += 1
        if type(self).patches == 1:
            self._answer(429, {"kind": "Status", "code": 429, "message": "slow down"})
        else:
            self._answer(200, {"kind": "Pod"})


@pytest.fixture
def apiserver() -> Iterator[str]:
    _ApiServer.patches = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_kubernetes_clients_requests_are_counted_by_verb_resource_and_code(
    apiserver: str,
) -> None:
    m = fresh()
    api = client.ApiClient(client.Configuration(host=apiserver))
    apicalls.instrument_client(api, m)
    apicalls.instrument_client(api, m)  # twice: still counted once
    core = client.CoreV1Api(api)
    assert kube.list_pods(core, "ns", "a=b") == []
    with pytest.raises(ApiException) as refused:
        kube.patch_pod_metadata(core, "ns", "p", {"labels": {"a": "b"}})
    assert refused.value.status == 429
    kube.patch_pod_metadata(core, "ns", "p", {"labels": {"a": "b"}})
    k = {"client": "kubernetes"}
    assert (
        value(m, "weightlift_api_requests_total", **k, verb="list", resource="pods", code="200")
        == 1
    )
    assert (
        value(m, "weightlift_api_requests_total", **k, verb="patch", resource="pods", code="429")
        == 1
    )
    assert (
        value(m, "weightlift_api_requests_total", **k, verb="patch", resource="pods", code="200")
        == 1
    )
    assert (
        value(
            m, "weightlift_api_request_duration_seconds_count", **k, verb="patch", resource="pods"
        )
        == 2
    )


def test_a_request_without_an_answer_is_counted_as_an_error() -> None:
    m = fresh()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = client.Configuration(host=f"http://127.0.0.1:{port}")
    config.retries = False
    api = client.ApiClient(config)
    apicalls.instrument_client(api, m)
    with pytest.raises(urllib3.exceptions.HTTPError):
        kube.list_pods(client.CoreV1Api(api), "ns", "a=b")
    assert value(
        m, "weightlift_api_requests_total", client="kubernetes", verb="list", resource="pods",
        code="<error>",
    ) >= 1  # fmt: skip


def test_the_operators_client_counts_into_the_operators_metrics(
    apiserver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": apiserver}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    labels = {"client": "kubernetes", "verb": "list", "resource": "pods", "code": "200"}
    before = value(METRICS, "weightlift_api_requests_total", **labels)
    kube.list_pods(client.CoreV1Api(kube.load_config()), "ns", "a=b")
    assert value(METRICS, "weightlift_api_requests_total", **labels) == before + 1


# ------------------------------------------------------------------------------------- kopf
async def test_kopfs_sessions_are_traced() -> None:
    m = fresh()

    async def watch(request: web.Request) -> web.Response:
        return web.json_response({"kind": "PodList", "items": []})

    async def too_many(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "code": 429}, status=429)

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods", watch)
    app.router.add_patch("/apis/weightlift.dev/v1alpha1/namespaces/ns/modeldeployments/m", too_many)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    original = auth.APIContext.__init__
    # The operator's own trace may be installed already (handlers imported): start unwrapped.
    auth.APIContext.__init__ = getattr(original, "__wrapped__", original)  # type: ignore[method-assign]
    try:
        assert apicalls.install_kopf(m)
        assert apicalls.install_kopf(m)  # idempotent: one trace per session
        context = auth.APIContext(credentials.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
        assert len(context.session.trace_configs) == 1
        base = f"http://127.0.0.1:{port}"
        async with context.session.get(f"{base}/api/v1/namespaces/ns/pods?watch=true") as r:
            await r.read()
        url = f"{base}/apis/weightlift.dev/v1alpha1/namespaces/ns/modeldeployments/m"
        async with context.session.patch(url, json={}) as r:
            assert r.status == 429
        await context.session.close()
    finally:
        auth.APIContext.__init__ = original  # type: ignore[method-assign]
        await runner.cleanup()
    k = {"client": "kopf"}
    assert (
        value(m, "weightlift_api_requests_total", **k, verb="watch", resource="pods", code="200")
        == 1
    )
    assert value(
        m, "weightlift_api_requests_total", **k, verb="patch", resource="modeldeployments",
        code="429",
    ) == 1  # fmt: skip
    # Watches last as long as the server keeps them open: no duration.
    assert (
        value(
            m, "weightlift_api_request_duration_seconds_count", **k, verb="watch", resource="pods"
        )
        == 0
    )


# ---------------------------------------------------------------------------------- /metrics
def test_metrics_are_served_in_prometheus_text_format() -> None:
    m = Metrics(CollectorRegistry())
    m.time_to_ready.labels(role="Source", loaded_from="storage:s3", engine="Builtin").observe(3.0)
    server = serve("127.0.0.1", 0, m)
    try:
        port = server.server_address[1]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.shutdown()
        server.server_close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ready = families["weightlift_replica_time_to_ready_seconds"]
    count = [s for s in ready.samples if s.name.endswith("_count")]
    assert [s.value for s in count] == [1.0]
    assert count[0].labels == {"role": "Source", "loaded_from": "storage:s3", "engine": "Builtin"}
    assert "process_resident_memory_bytes" in families  # the process collector
    for name in ("weightlift_api_requests", "weightlift_reconcile", "weightlift_storage_fallbacks"):
        assert families[name].type == "counter"


def test_the_metrics_port_is_an_operator_setting() -> None:
    assert Settings.from_environment({}).metrics_port is None  # not served
    chosen = Settings.from_environment({METRICS_PORT_ENV: "9400", METRICS_HOST_ENV: "10.0.0.7"})
    assert (chosen.metrics_port, chosen.metrics_host) == (9400, "10.0.0.7")
    assert Settings.from_environment({METRICS_PORT_ENV: "8081"}).metrics_host == "0.0.0.0"
    for bad in ("http", "0", "70000"):
        with pytest.raises(ValueError, match=METRICS_PORT_ENV):
            Settings.from_environment({METRICS_PORT_ENV: bad})
