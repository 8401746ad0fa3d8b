"""The engine's own metrics on the worker's /metrics: vLLM's `vllm:*` (the text vLLM 0.32's own
stat logger wrote, tests/support/vllm_metrics.py) and Triton's `nv_*`, through one function
(engines/exposition.py): kept by prefix, every sample labelled with the replica, names as the
engine wrote them (colons, counters with or without `_total`), and the worker's whole /metrics
readable by prometheus_client's parser."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.support.vllm_metrics import exposition
from tests.support.worker import free_port, make_plan
from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.exposition import relabel, replica_labels
from weightlift.worker.engines.triton.engine import TritonEngine
from weightlift.worker.engines.vllm.engine import VllmEngine
from weightlift.worker.server import WorkerState, build_app

LABELS = {"deployment": "llama", "replica": "1"}
# Triton 2.51's families as tritonserver writes them: counters without `_total`, integer values,
# a histogram, a gauge without labels.
TRITON = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="llama",version="1"} 3
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="llama",version="1"} 1234
# HELP nv_pinned_memory_pool_total_bytes Pinned memory pool total memory size, in bytes
# TYPE nv_pinned_memory_pool_total_bytes gauge
nv_pinned_memory_pool_total_bytes 0
# HELP nv_inference_first_response_histogram_ms Duration from request to first response in ms
# TYPE nv_inference_first_response_histogram_ms histogram
nv_inference_first_response_histogram_ms_count{model="llama",version="1"} 3
nv_inference_first_response_histogram_ms_sum{model="llama",version="1"} 40
nv_inference_first_response_histogram_ms_bucket{model="llama",version="1",le="100"} 3
nv_inference_first_response_histogram_ms_bucket{model="llama",version="1",le="+Inf"} 3
"""


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _vllm_lines(text: str) -> list[str]:
    """The fixture's lines of vLLM's own families (HELP, TYPE, samples), in order."""
    return [
        line
        for line in text.splitlines()
        if line.startswith("vllm:") or line.startswith(("# HELP vllm:", "# TYPE vllm:"))
    ]


def test_vllm_families_come_through_verbatim_but_for_the_replica_labels() -> None:
    text = exposition()
    # With no labels to add, the text of vLLM's families as vLLM wrote it, line for line.
    assert relabel(text, ("vllm:",), {}).splitlines() == _vllm_lines(text)
    out = relabel(text, ("vllm:",), LABELS)
    before, after = _families(text), _families(out)
    assert set(after) == {name for name in before if name.startswith("vllm:")}
    assert "python_gc_objects_collected" in before and "process_cpu_seconds" in before
    for name, family in after.items():
        original = before[name]
        assert (family.type, family.documentation) == (original.type, original.documentation)
        assert [(s.name, s.labels, s.value) for s in family.samples] == [
            (s.name, {**s.labels, **LABELS}, s.value) for s in original.samples
        ], name
    # The series a dashboard and an autoscaler read, with colons, labelled with the replica.
    assert after["vllm:num_requests_waiting"].samples[0].labels == {
        "engine": "0",
        "model_name": "tiny",
        **LABELS,
    }
    assert after["vllm:num_requests_waiting"].samples[0].value == 2.0
    assert after["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    ttft = after["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    counts = [s for s in ttft.samples if s.name == "vllm:time_to_first_token_seconds_count"]
    assert [(s.value, s.labels["replica"]) for s in counts] == [(2.0, "1")]
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny",deployment="llama",' in out
    assert "# TYPE vllm:prompt_tokens_total counter\n" in out


def test_triton_counters_keep_their_names_without_total() -> None:
    out = relabel(TRITON, ("nv_",), {"deployment": "t", "replica": "0"})
    assert "# TYPE nv_inference_request_success counter\n" in out
    assert (
        'nv_inference_request_success{model="llama",version="1",deployment="t",replica="0"} 3.0\n'
        in out
    )
    assert "_total{" not in out and "nv_pinned_memory_pool_total_bytes{" in out
    after = _families(out)
    assert set(after) == {
        "nv_inference_request_success",
        "nv_inference_queue_duration_us",
        "nv_pinned_memory_pool_total_bytes",
        "nv_inference_first_response_histogram_ms",
    }
    buckets = [
        s for s in after["nv_inference_first_response_histogram_ms"].samples if "le" in s.labels
    ]
    assert [(s.labels["le"], s.labels["replica"]) for s in buckets] == [("100", "0"), ("+Inf", "0")]


def test_odd_input_is_escaped_replaced_or_left_out() -> None:
    text = (
        "# HELP vllm:odd A \\\\ backslash and a\\nnewline\n"
        "# TYPE vllm:odd gauge\n"
        'vllm:odd{model_name="a \\"quoted\\" \\\\ name\\n",replica="engine-own"} 1 1700000000123\n'
        "other_family 2\n"
    )
    out = relabel(text, ("vllm:",), LABELS)
    (family,) = text_string_to_metric_families(out)
    assert family.documentation == "A \\ backslash and a\nnewline"
    (sample,) = family.samples
    # Ours replace an engine label of the same name; values survive the round trip.
    assert sample.labels == {"model_name": 'a "quoted" \\ name\n', **LABELS}
    assert sample.timestamp == 1700000000.123
    # A name the classic text format cannot carry (UTF-8, quoted) is left out, not broken.
    quoted = '# TYPE "vllm:a.b" gauge\n{"vllm:a.b",x="1"} 1\n'
    assert relabel(quoted, ("vllm:",), LABELS) == ""
    # Text the parser refuses gives nothing: the worker's own families still scrape.
    assert relabel("vllm:broken{ 1\n", ("vllm:",), LABELS) == ""
    assert relabel("", ("vllm:",), LABELS) == ""
    assert replica_labels("llama", 3) == {"deployment": "llama", "replica": "3"}


class FakeEngineServer:
    """An engine's metrics endpoint on loopback: serves `text` at /metrics, keeps each request's
    Authorization header."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.auth: list[str | None] = []
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        self.server = TestServer(app, host="127.0.0.1")

    async def metrics(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        return web.Response(text=self.text, content_type="text/plain")


@pytest.fixture
async def engine_server() -> AsyncIterator[Callable[[str], Any]]:
    started: list[FakeEngineServer] = []

    async def start(text: str) -> FakeEngineServer:
        fake = FakeEngineServer(text)
        await fake.server.start_server()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        await fake.server.close()


def _vllm_plan(tmp_path: Path, engine_port: int) -> WorkerPlan:
    return make_plan(
        tmp_path,
        deployment="llama",
        replica=1,
        runtime={"engine": "vLLM", "port": free_port(), "enginePort": engine_port},
    )


def _triton_plan(tmp_path: Path, metrics_port: int) -> WorkerPlan:
    return make_plan(
        tmp_path,
        deployment="llama",
        replica=1,
        runtime={
            "engine": "Triton",
            "port": free_port(),
            "enginePort": free_port(),
            "engineGrpcPort": free_port(),
            "engineMetricsPort": metrics_port,
        },
    )


async def _worker_metrics(plan: WorkerPlan, engine: VllmEngine) -> str:
    state = WorkerState.for_plan(plan)
    state.engine = engine
    try:
        async with TestClient(TestServer(build_app(state))) as client:
            resp = await client.get("/metrics")
            assert resp.status == 200
            return await resp.text()
    finally:
        await engine.stop()


async def test_the_workers_metrics_carry_vllms_series_labelled_with_the_replica(
    tmp_path: Path, engine_server: Callable[[str], Any]
) -> None:
    fake = await engine_server(exposition())
    plan = _vllm_plan(tmp_path, fake.server.port)
    engine = VllmEngine(plan, tmp_path / "engine")
    text = await _worker_metrics(plan, engine)
    families = _families(text)  # the whole /metrics, the worker's and vLLM's, parses
    assert {"weightlift_bytes_loaded", "weightlift_ready"} <= set(families)
    assert not [n for n in families if n.startswith(("python_", "process_"))]  # vLLM's process
    running = families["vllm:num_requests_running"].samples
    assert [(s.labels["deployment"], s.labels["replica"], s.value) for s in running] == [
        ("llama", "1", 1.0)
    ]
    vllm_samples = [s for n, f in families.items() if n.startswith("vllm:") for s in f.samples]
    assert vllm_samples and all(s.labels.items() >= LABELS.items() for s in vllm_samples)
    assert "\nvllm:num_requests_running{" in text  # the name as vLLM wrote it, unquoted
    assert fake.auth == [f"Bearer {engine.api_key}"]  # vLLM got the worker's key


async def test_tritons_series_come_through_the_same_way(
    tmp_path: Path, engine_server: Callable[[str], Any]
) -> None:
    fake = await engine_server(TRITON + exposition())  # vllm:* from Triton's port: not Triton's
    plan = _triton_plan(tmp_path, fake.server.port)
    text = await _worker_metrics(plan, TritonEngine(plan, tmp_path / "engine"))
    families = _families(text)
    assert not [n for n in families if n.startswith("vllm:")]
    (success,) = families["nv_inference_request_success"].samples
    assert (success.labels["replica"], success.value) == ("1", 3.0)
    assert '\nnv_inference_request_success{model="llama",version="1",deployment="llama",' in text
    assert fake.auth == [None]  # vLLM's key never goes to Triton's metrics port


async def test_an_engine_that_does_not_answer_leaves_the_workers_own_metrics(
    tmp_path: Path,
) -> None:
    plan = _vllm_plan(tmp_path, free_port())
    text = await _worker_metrics(plan, VllmEngine(plan, tmp_path / "engine"))
    families = _families(text)
    assert "weightlift_ready" in families
    assert not [n for n in families if n.startswith("vllm:")]
