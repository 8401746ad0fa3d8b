"""Inference probes and worker status reads against a real (small) KServe v2 HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from weightlift.api.model import InferenceProbe, ProbeResult
from weightlift.local.net import free_port
from weightlift.operator.probes import (
    WorkerClient,
    fetch_report,
    probe_inference,
    request_from_metadata,
)
from weightlift.operator.settings import MODEL_PATH_PREFIXES_ENV, PROBE_NETWORKS_ENV, Settings

MODEL = "adder"
METADATA = {
    "name": MODEL,
    "platform": "pytorch_torchscript",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}],
}
REQUEST = {
    "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
}


def output(
    data: list[Any], name: str = "OUTPUT0", shape: list[int] | None = None
) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": shape or [1, len(data)], "data": data}


@dataclass
class Worker:
    """What the fake worker answers; tests change it between probes."""

    outputs: list[dict[str, Any]] = field(default_factory=lambda: [output([2, 4, 6, 8])])
    infer_status: int = 200
    infer_body: Any = None  # replaces {"outputs": ...} when set
    metadata: Any = field(default_factory=lambda: dict(METADATA))
    metadata_status: int = 200
    delay: float = 0.0
    status_body: Any = None
    status_code: int = 200
    infer_requests: list[Any] = field(default_factory=list)
    address: str = ""
    in_flight: int = 0
    most_in_flight: int = 0


WORKER = web.AppKey("worker", Worker)


async def _metadata(request: web.Request) -> web.Response:
    worker: Worker = request.app[WORKER]
    if request.match_info["model"] != MODEL:
        return web.json_response({"error": "unknown model"}, status=404)
    return web.json_response(worker.metadata, status=worker.metadata_status)


async def _infer(request: web.Request) -> web.Response:
    worker: Worker = request.app[WORKER]
    worker.infer_requests.append(await request.json())
    worker.in_flight += 1
    worker.most_in_flight = max(worker.most_in_flight, worker.in_flight)
    try:
        if worker.delay:
            await asyncio.sleep(worker.delay)
    finally:
        worker.in_flight -= 1
    if request.match_info["model"] != MODEL:
        return web.json_response({"error": "unknown model"}, status=404)
    if worker.infer_status != 200:
        return web.json_response({"error": "CUDA error: boom"}, status=worker.infer_status)
    body = worker.infer_body if worker.infer_body is not None else {"outputs": worker.outputs}
    return web.json_response(body)


async def _status(request: web.Request) -> web.Response:
    worker: Worker = request.app[WORKER]
    if worker.status_body is None:
        return web.Response(status=404)
    if isinstance(worker.status_body, str):
        return web.Response(text=worker.status_body, status=worker.status_code)
    return web.json_response(worker.status_body, status=worker.status_code)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    state = Worker()
    app = web.Application()
    app[WORKER] = state
    app.router.add_get("/v2/models/{model}", _metadata)
    app.router.add_post("/v2/models/{model}/infer", _infer)
    app.router.add_get("/weightlift/v1/status", _status)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.address = f"{host}:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[WorkerClient]:
    """The client the operator uses (aiohttp, at most MAX_WORKER_REQUESTS in flight)."""
    async with WorkerClient() as client:
        yield client


def make_probe(**overrides: Any) -> InferenceProbe:
    wire: dict[str, Any] = {
        "request": REQUEST,
        "expectedOutputs": [{"name": "OUTPUT0", "shape": [1, 4], "data": [2, 4, 6, 8]}],
        "tolerance": 0.01,
        "timeoutSeconds": 1,
        "failureThreshold": 3,
    }
    wire.update(overrides)
    return InferenceProbe.model_validate(wire)


async def probe(
    http: WorkerClient,
    worker: Worker,
    spec: InferenceProbe | None,
    previous: ProbeResult | None = None,
) -> ProbeResult:
    return await probe_inference(http, worker.address, MODEL, spec, previous)


# ----------------------------------------------------------------------- expected outputs


async def test_outputs_within_tolerance_pass(http: WorkerClient, worker: Worker) -> None:
    worker.outputs = [output([2.005, 3.995, 6.0, 8.009])]
    result = await probe(http, worker, make_probe())
    assert result.passed, result.message
    assert result.consecutive_failures == 0
    assert result.latency_ms is not None and result.latency_ms > 0
    assert result.last_probe_time is not None and result.last_probe_time.endswith("Z")
    # The request body the user wrote is what the worker received.
    assert worker.infer_requests == [REQUEST]


async def test_an_output_off_by_more_than_tolerance_fails_naming_output_and_index(
    http: WorkerClient, worker: Worker
) -> None:
    worker.outputs = [output([2, 4, 6.02, 8])]
    result = await probe(http, worker, make_probe())
    assert not result.passed
    assert "'OUTPUT0'[2]" in result.message
    assert "6.02" in result.message
    assert result.consecutive_failures == 1


async def test_a_missing_output_fails_and_lists_what_came_back(
    http: WorkerClient, worker: Worker
) -> None:
    worker.outputs = [output([2, 4, 6, 8], name="LOGITS")]
    result = await probe(http, worker, make_probe())
    assert not result.passed
    assert "'OUTPUT0' missing" in result.message
    assert "LOGITS" in result.message


async def test_a_wrong_shape_or_count_fails(http: WorkerClient, worker: Worker) -> None:
    worker.outputs = [output([2, 4, 6, 8], shape=[4, 1])]
    shape = await probe(http, worker, make_probe())
    assert not shape.passed and "shape" in shape.message

    worker.outputs = [output([2, 4, 6])]
    count = await probe(
        http, worker, make_probe(expectedOutputs=[{"name": "OUTPUT0", "data": [2, 4, 6, 8]}])
    )
    assert not count.passed and "3 values, expected 4" in count.message


async def test_non_finite_outputs_fail(http: WorkerClient, worker: Worker) -> None:
    # JSON has no NaN literal, but Python's json (and many servers) emit one.
    worker.outputs = [output([2, float("nan"), 6, 8])]
    result = await probe(http, worker, make_probe(tolerance=1000))
    assert not result.passed
    assert "non-finite" in result.message


async def test_http_500_fails_with_the_status_and_body(http: WorkerClient, worker: Worker) -> None:
    worker.infer_status = 500
    result = await probe(http, worker, make_probe())
    assert not result.passed
    assert "HTTP 500" in result.message
    assert "CUDA error" in result.message


async def test_a_slow_worker_times_out(http: WorkerClient, worker: Worker) -> None:
    worker.delay = 3.0
    started = asyncio.get_running_loop().time()
    result = await probe(http, worker, make_probe(timeoutSeconds=1))
    elapsed = asyncio.get_running_loop().time() - started
    assert not result.passed
    assert "Timeout" in result.message
    assert elapsed < 2.5


async def test_a_refused_connection_fails(http: WorkerClient) -> None:
    dead = Worker(address=f"127.0.0.1:{free_port()}")
    result = await probe(http, dead, make_probe())
    assert not result.passed
    assert "infer request failed" in result.message


@pytest.mark.parametrize(
    "body",
    [[], "ok", {"outputs": "nope"}, {"outputs": [1, 2]}, {"outputs": [{"name": "OUTPUT0"}]}],
    ids=["list", "string", "outputs-string", "outputs-not-objects", "output-without-data"],
)
async def test_malformed_responses_fail_instead_of_raising(
    http: WorkerClient, worker: Worker, body: Any
) -> None:
    worker.infer_body = body
    result = await probe(http, worker, make_probe())
    assert not result.passed
    assert result.message


# ---------------------------------------------------------------- no expected outputs: metadata


async def test_without_a_probe_the_request_comes_from_metadata(
    http: WorkerClient, worker: Worker
) -> None:
    worker.outputs = [output([0, 0, 0, 0])]
    result = await probe(http, worker, None)
    assert result.passed, result.message
    assert worker.infer_requests == [
        {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
    ]


@pytest.mark.parametrize(
    ("outputs", "complaint"),
    [
        ([output([0] * 4, name="OTHER")], "'OUTPUT0' declared in metadata but missing"),
        ([{**output([0] * 4), "datatype": "INT64"}], "datatype INT64 != FP32"),
        ([output([0] * 8, shape=[2, 2, 2])], "shape [2, 2, 2] != [-1, 4]"),
        ([output([0] * 3, shape=[1, 3])], "shape [1, 3] != [-1, 4]"),
    ],
)
async def test_without_expected_outputs_names_datatypes_and_shapes_are_checked(
    http: WorkerClient, worker: Worker, outputs: list[dict[str, Any]], complaint: str
) -> None:
    worker.outputs = outputs
    for spec in (None, make_probe(expectedOutputs=[])):
        result = await probe(http, worker, spec)
        assert not result.passed
        assert complaint in result.message


async def test_a_probe_without_expected_outputs_sends_its_own_request(
    http: WorkerClient, worker: Worker
) -> None:
    worker.outputs = [output([9, 9, 9, 9], shape=[3, 4])]  # -1 matches any batch size
    result = await probe(http, worker, make_probe(expectedOutputs=[]))
    assert result.passed, result.message
    assert worker.infer_requests == [REQUEST]


async def test_metadata_errors_fail_the_probe(http: WorkerClient, worker: Worker) -> None:
    worker.metadata_status = 503
    result = await probe(http, worker, None)
    assert not result.passed
    assert "503" in result.message
    assert worker.infer_requests == []

    worker.metadata_status = 200
    worker.metadata = ["not", "metadata"]
    garbage = await probe(http, worker, None)
    assert not garbage.passed


def test_request_from_metadata_fills_zeros_and_resolves_dynamic_dims() -> None:
    metadata = {
        "inputs": [
            {"name": "ids", "datatype": "INT64", "shape": [-1, 3]},
            {"name": "mask", "datatype": "BOOL", "shape": [2, -1, 2]},
            {"name": "scalar", "datatype": "FP32", "shape": []},
        ]
    }
    assert request_from_metadata(metadata) == {
        "inputs": [
            {"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [0, 0, 0]},
            {"name": "mask", "shape": [2, 1, 2], "datatype": "BOOL", "data": [0] * 4},
            {"name": "scalar", "shape": [], "datatype": "FP32", "data": [0]},
        ]
    }
    assert request_from_metadata({}) == {"inputs": []}


# --------------------------------------------------------------------- consecutive failures


async def test_a_passing_replica_stays_passed_until_the_failure_threshold(
    http: WorkerClient, worker: Worker
) -> None:
    spec = make_probe(failureThreshold=3)
    result = await probe(http, worker, spec)
    assert result.passed

    worker.infer_status = 500
    seen: list[tuple[bool, int]] = []
    for _ in range(4):
        result = await probe(http, worker, spec, result)
        seen.append((result.passed, result.consecutive_failures))
    assert seen == [(True, 1), (True, 2), (False, 3), (False, 4)]
    assert "HTTP 500" in result.message

    worker.infer_status = 200
    recovered = await probe(http, worker, spec, result)
    assert recovered.passed
    assert recovered.consecutive_failures == 0


async def test_one_success_resets_the_failure_count(http: WorkerClient, worker: Worker) -> None:
    spec = make_probe(failureThreshold=2)
    result = await probe(http, worker, spec)
    worker.infer_status = 500
    result = await probe(http, worker, spec, result)
    assert (result.passed, result.consecutive_failures) == (True, 1)
    worker.infer_status = 200
    result = await probe(http, worker, spec, result)
    worker.infer_status = 500
    result = await probe(http, worker, spec, result)
    assert (result.passed, result.consecutive_failures) == (True, 1)


async def test_a_replica_that_never_passed_fails_at_once(
    http: WorkerClient, worker: Worker
) -> None:
    worker.infer_status = 500
    spec = make_probe(failureThreshold=5)
    first = await probe(http, worker, spec)
    assert (first.passed, first.consecutive_failures) == (False, 1)
    second = await probe(http, worker, spec, first)
    assert (second.passed, second.consecutive_failures) == (False, 2)


async def test_threshold_one_flips_on_the_first_failure(http: WorkerClient, worker: Worker) -> None:
    spec = make_probe(failureThreshold=1)
    passed = await probe(http, worker, spec)
    worker.infer_status = 500
    failed = await probe(http, worker, spec, passed)
    assert not failed.passed


# ----------------------------------------------------------------------------- fetch_report


async def test_fetch_report_parses_the_worker_status(http: WorkerClient, worker: Worker) -> None:
    worker.status_body = {
        "phase": "Loading",
        "role": "Target",
        "loadedFrom": "peer:llama-abc-0",
        "bytesLoaded": 1024,
        "bytesTotal": 4096,
        "gbps": 12.5,
        "hooksRun": True,
    }
    report = await fetch_report(http, worker.address)
    assert report is not None
    assert report.phase == "Loading"
    assert report.loaded_from == "peer:llama-abc-0"
    assert (report.bytes_loaded, report.bytes_total) == (1024, 4096)
    assert report.gbps == 12.5
    assert report.hooks_run is True


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (None, 404),
        ("<html>not json</html>", 200),
        ({"bytesLoaded": "lots"}, 200),
        (["a", "list"], 200),
        ({"phase": "Serving"}, 500),
    ],
    ids=["404", "not-json", "wrong-type", "list", "500"],
)
async def test_fetch_report_returns_none_for_anything_but_a_report(
    http: WorkerClient, worker: Worker, body: Any, code: int
) -> None:
    worker.status_body, worker.status_code = body, code
    assert await fetch_report(http, worker.address) is None


async def test_fetch_report_returns_none_when_refused(http: WorkerClient) -> None:
    assert await fetch_report(http, f"127.0.0.1:{free_port()}") is None


# ------------------------------------------------------------------------------ may_contact


def may_contact(ip: str, networks: str | None = None) -> bool:
    env = {} if networks is None else {PROBE_NETWORKS_ENV: networks}
    return Settings.from_environment(env).may_contact(ip)


def test_may_contact_anything_when_unrestricted() -> None:
    assert may_contact("10.244.1.7")
    assert may_contact("127.0.0.1")


def test_may_contact_only_inside_the_configured_networks() -> None:
    nets = "127.0.0.0/8, 10.1.0.0/16,fd00::/8"
    assert may_contact("127.0.3.4", nets)
    assert may_contact("10.1.200.3", nets)
    assert may_contact("fd00::12", nets)
    assert not may_contact("10.2.0.1", nets)
    assert not may_contact("192.168.1.1", nets)
    assert not may_contact("2001:db8::1", nets)
    assert not may_contact("not-an-ip", nets)
    assert not may_contact("", nets)


def test_may_contact_ignores_blank_entries() -> None:
    assert may_contact("127.0.0.1", "127.0.0.0/8, ,")
    assert not may_contact("10.0.0.1", "127.0.0.0/8, ,")


def test_a_bad_network_or_prefix_names_its_variable() -> None:
    with pytest.raises(ValueError, match=PROBE_NETWORKS_ENV):
        Settings.from_environment({PROBE_NETWORKS_ENV: "10.0.0.0/33"})
    with pytest.raises(ValueError, match=MODEL_PATH_PREFIXES_ENV):
        Settings.from_environment({MODEL_PATH_PREFIXES_ENV: "models/relative"})
    settings = Settings.from_environment({MODEL_PATH_PREFIXES_ENV: "/data, /models"})
    assert settings.model_path_prefixes == ("/data", "/models")


async def test_requests_beyond_the_bound_wait_and_all_complete(worker: Worker) -> None:
    """At most `limit` requests reach the pool; the rest wait their turn (not failing with a
    timeout: the wait is outside the request's timeout) and each slot comes back."""
    worker.delay = 0.05
    async with WorkerClient(limit=3) as client:
        spec = make_probe(timeoutSeconds=1)
        results = await asyncio.gather(*(probe(client, worker, spec) for _ in range(40)))
        assert all(r.passed for r in results), [r.message for r in results if not r.passed]
        assert worker.most_in_flight == 3
        # Failed requests give their slot back too: a refused port, then real work again.
        refused = await asyncio.gather(
            *(probe_inference(client, "127.0.0.1:1", MODEL, spec, None) for _ in range(5))
        )
        assert not any(r.passed for r in refused)
        again = await asyncio.gather(*(probe(client, worker, spec) for _ in range(6)))
        assert all(r.passed for r in again)
