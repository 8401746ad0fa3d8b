"""An External runtime's protocol (spec.runtime.protocol): the kubelet's health paths and port,
the operator's inference probe, admission of bad values, and old manifests' pods unchanged."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from tests.unit.operator.test_pods import container, render
from weightlift.api import limits
from weightlift.api.crd import build_crd
from weightlift.api.labels import TEMPLATE_LABEL
from weightlift.api.model import (
    COMPLETION_PROTOCOL_MESSAGE,
    PROBE_NEEDS_COMPLETION_MESSAGE,
    PROTOCOL_ENDPOINTS,
    CompletionProtocol,
    ModelDeploymentSpec,
    ServingProtocol,
    inference_call,
)
from weightlift.operator.identity import pod_template_revision
from weightlift.operator.probes import WorkerClient, probe_inference

GOLDEN = Path(__file__).parent / "golden" / "pods_before_protocol.json"
COMPLETION: dict[str, Any] = {"prompt": "hello", "maxTokens": 4, "expectedText": "world"}
REQUEST: dict[str, Any] = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]
}
# A KServe v2 probe that needs no model metadata first.
INFER: dict[str, Any] = {"request": REQUEST, "expectedOutputs": [{"name": "y", "data": [2.0]}]}


def external(
    protocol: str | None = None, probe: dict[str, Any] | None = None, **runtime: Any
) -> dict[str, Any]:
    """The wire form of an External runtime's spec (a safetensors model it loads itself)."""
    body: dict[str, Any] = {"type": "External", "command": ["vllm", "serve", "/m"], **runtime}
    if protocol is not None:
        body["protocol"] = protocol
    wire: dict[str, Any] = {
        "model": {"uri": "hostpath:///models/llm", "format": "safetensors"},
        "runtime": body,
    }
    if probe is not None:
        wire["probe"] = probe
    return wire


def spec_of(wire: dict[str, Any]) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(wire)


def health(spec: ModelDeploymentSpec) -> tuple[str, str, Any, list[dict[str, Any]]]:
    """(readiness path, liveness path, the probes' port, the container's ports)."""
    worker = container(render(spec))
    ready, live = worker["readinessProbe"]["httpGet"], worker["livenessProbe"]["httpGet"]
    assert ready["port"] == live["port"]
    return ready["path"], live["path"], ready["port"], worker["ports"]


# ------------------------------------------------------------------- the kubelet's probes


@pytest.mark.parametrize(
    ("protocol", "probe", "ready", "live"),
    [
        (None, None, "/v2/health/ready", "/v2/health/live"),
        ("KServeV2", None, "/v2/health/ready", "/v2/health/live"),
        ("Triton", None, "/v2/health/ready", "/v2/health/live"),
        # vllm serve: GET /health (vllm/entrypoints/serve/instrumentator/health.py, 0.32)
        ("OpenAI", {"completion": COMPLETION}, "/health", "/health"),
    ],
)
def test_each_protocol_gives_the_health_paths_its_server_answers(
    protocol: str | None, probe: dict[str, Any] | None, ready: str, live: str
) -> None:
    path_ready, path_live, port, ports = health(spec_of(external(protocol, probe)))
    assert (path_ready, path_live) == (ready, live)
    assert port == "http"
    assert ports == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize(("seconds", "failures"), [(None, 360), (60, 12), (62, 13)])
def test_an_external_server_gets_a_startup_budget_before_liveness_counts(
    seconds: int | None, failures: int
) -> None:
    """A stock vLLM opens its port only once its weights are loaded: liveness alone (10 s delay,
    6 x 10 s) would kill it 70 s into a big model's load."""
    extra = {} if seconds is None else {"startupSeconds": seconds}
    worker = container(render(spec_of(external("OpenAI", {"completion": COMPLETION}, **extra))))
    startup = worker["startupProbe"]
    assert startup["httpGet"] == worker["livenessProbe"]["httpGet"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= (seconds or 1800)
    assert startup["failureThreshold"] == failures


def test_the_builtin_worker_answers_at_once_and_has_no_startup_probe() -> None:
    builtin = spec_of({"model": {"uri": "hostpath:///m"}})
    assert "startupProbe" not in container(render(builtin))
    with pytest.raises(ValidationError, match=r"spec\.runtime\.startupSeconds applies to runtime"):
        ModelDeploymentSpec.model_validate(
            {"model": {"uri": "hostpath:///m"}, "runtime": {"startupSeconds": 60}}
        )


def test_explicit_paths_and_port_win_over_the_protocols() -> None:
    wire = external(
        "OpenAI",
        {"completion": COMPLETION},
        port=9000,
        readinessPath="/v1/models",
        livenessPath="/ping?deep=1",
    )
    ready, live, port, ports = health(spec_of(wire))
    assert (ready, live) == ("/v1/models", "/ping?deep=1")
    assert port == "http" and ports == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    # one override leaves the other path to the protocol
    ready, live, _, _ = health(spec_of(external("Triton", livenessPath="/alive")))
    assert (ready, live) == ("/v2/health/ready", "/alive")


def test_the_operator_probes_the_runtime_port() -> None:
    """The address the operator probes and the pod's http port are the same runtime.port."""
    spec = spec_of(external("OpenAI", {"completion": COMPLETION}, port=9000))
    assert spec.runtime.port == 9000
    assert container(render(spec))["ports"][0]["containerPort"] == spec.runtime.port


@pytest.mark.parametrize("engine", ["Builtin", "vLLM", "Triton"])
def test_the_worker_keeps_its_own_health_paths(engine: str) -> None:
    fmt = "pt2" if engine == "Builtin" else "safetensors"
    wire = {"model": {"uri": "hostpath:///m", "format": fmt}, "runtime": {"engine": engine}}
    ready, live, _, _ = health(spec_of(wire))
    assert (ready, live) == ("/v2/health/ready", "/v2/health/live")


# ---------------------------------------------------------------- the operator's probe


@pytest.mark.parametrize(
    ("wire", "call"),
    [
        (external(None), None),
        (external(None, {"request": REQUEST}), None),
        (external(None, {"completion": COMPLETION}), CompletionProtocol.OPENAI),
        (
            external(None, {"completion": {**COMPLETION, "protocol": "TritonGenerate"}}),
            CompletionProtocol.TRITON_GENERATE,
        ),
        (external("KServeV2", {"request": REQUEST}), None),
        (external("Triton"), None),
        (external("Triton", {"completion": COMPLETION}), CompletionProtocol.TRITON_GENERATE),
        (external("OpenAI", {"completion": COMPLETION}), CompletionProtocol.OPENAI),
        # the worker's front door: OpenAI unless the probe says otherwise, as before
        (
            {
                "model": {"uri": "hostpath:///m", "format": "safetensors"},
                "runtime": {"engine": "vLLM"},
                "probe": {"completion": COMPLETION},
            },
            CompletionProtocol.OPENAI,
        ),
        ({"model": {"uri": "hostpath:///m"}}, None),
    ],
)
def test_inference_call_follows_the_protocol(
    wire: dict[str, Any], call: CompletionProtocol | None
) -> None:
    spec = spec_of(wire)
    assert inference_call(spec.runtime, spec.probe) == call


class Server:
    """A fake inference server: answers every protocol's probe and records what it was sent."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.address = ""

    async def answer(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        if request.path == "/v1/completions":
            return web.json_response({"choices": [{"index": 0, "text": "world"}]})
        if request.path.endswith("/generate"):
            return web.json_response({"text_output": "world"})
        if request.path.endswith("/infer"):
            return web.json_response(
                {"outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [2.0]}]}
            )
        return web.json_response({"error": "no"}, status=404)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    fake = Server()
    app = web.Application()
    app.router.add_post("/{tail:.*}", fake.answer)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    fake.address = f"127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("wire", "path"),
    [
        (external("OpenAI", {"completion": COMPLETION}), "/v1/completions"),
        (external("Triton", {"completion": COMPLETION}), "/v2/models/llm/generate"),
        (external("Triton", INFER), "/v2/models/llm/infer"),
        (external(None, {"completion": COMPLETION}), "/v1/completions"),
        (external("KServeV2", INFER), "/v2/models/llm/infer"),
    ],
)
async def test_the_probe_sends_what_the_protocol_answers(
    server: Server, wire: dict[str, Any], path: str
) -> None:
    spec = spec_of(wire)
    async with WorkerClient() as client:
        result = await probe_inference(
            client, server.address, "llm", spec.probe, None, spec.runtime
        )
    assert result.passed, result.message
    assert server.paths == [path]


# -------------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("wire", "named"),
    [
        (external("OpenAI", {"completion": COMPLETION}, readinessPath="health"), "readinessPath"),
        (external("OpenAI", {"completion": COMPLETION}, livenessPath=""), "livenessPath"),
        (external(None, livenessPath="/a b"), "livenessPath"),
        (external(None, readinessPath="/" + "x" * limits.HTTP_PATH_MAX), "readinessPath"),
        (external(None, port=80), "runtime.port"),
        (external(None, port=70000), "runtime.port"),
        (external("gRPC"), "runtime.protocol"),
        (external("openai"), "runtime.protocol"),
        (external("OpenAI"), "spec.probe.completion is required"),
        (external("OpenAI", {"request": REQUEST}), "spec.probe.completion is required"),
        (
            external("OpenAI", {"completion": {**COMPLETION, "protocol": "TritonGenerate"}}),
            "spec.probe.completion.protocol",
        ),
        (
            external("Triton", {"completion": {**COMPLETION, "protocol": "OpenAI"}}),
            "spec.probe.completion.protocol",
        ),
        (
            {"model": {"uri": "hostpath:///m"}, "runtime": {"protocol": "OpenAI"}},
            "spec.runtime.protocol applies to runtime.type External",
        ),
        (
            {"model": {"uri": "hostpath:///m"}, "runtime": {"readinessPath": "/ready"}},
            "spec.runtime.readinessPath applies to runtime.type External",
        ),
        (
            {"model": {"uri": "hostpath:///m"}, "runtime": {"livenessPath": "/live"}},
            "spec.runtime.livenessPath applies to runtime.type External",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(wire: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        spec_of(wire)
    assert named in str(caught.value)


def test_the_messages_name_the_fields_and_the_choices() -> None:
    assert PROBE_NEEDS_COMPLETION_MESSAGE.startswith(
        "spec.probe.completion is required with spec.runtime.protocol OpenAI"
    )
    assert COMPLETION_PROTOCOL_MESSAGE == (
        "spec.probe.completion.protocol must be one spec.runtime.protocol's server answers "
        "(KServeV2: OpenAI or TritonGenerate; Triton: TritonGenerate; OpenAI: OpenAI)"
    )


def test_the_crd_carries_the_same_rules() -> None:
    """The API server refuses what pydantic refuses: the enum, the path pattern, the External-
    only fields and the probe rules, each naming its field (tests/integration checks them live)."""
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    runtime = spec["properties"]["runtime"]
    props = runtime["properties"]
    assert props["protocol"]["enum"] == [str(p) for p in ServingProtocol]
    assert "default" not in props["protocol"]  # unset keeps old objects' plans byte for byte
    for name in ("readinessPath", "livenessPath"):
        assert props[name]["pattern"] == limits.HTTP_PATH
        assert props[name]["maxLength"] == limits.HTTP_PATH_MAX
        assert "/health" in props[name]["description"]
    assert [r["fieldPath"] for r in runtime["x-kubernetes-validations"]] == [
        ".protocol",
        ".readinessPath",
        ".livenessPath",
        ".startupSeconds",
    ]
    assert "default" not in props["startupSeconds"]
    rules = {r["fieldPath"]: r for r in spec["x-kubernetes-validations"]}
    assert rules[".probe.completion"]["message"] == PROBE_NEEDS_COMPLETION_MESSAGE
    assert rules[".probe.completion.protocol"]["message"] == COMPLETION_PROTOCOL_MESSAGE
    for protocol, endpoints in PROTOCOL_ENDPOINTS.items():
        assert f"'{protocol}': [" in rules[".probe.completion.protocol"]["rule"]
        assert endpoints.readiness_path in props["protocol"]["description"]
    completion = spec["properties"]["probe"]["properties"]["completion"]
    assert "default" not in completion["properties"]["protocol"]


@pytest.mark.parametrize(
    "wire",
    [
        external("OpenAI", {"completion": COMPLETION}, readinessPath="/health?x=1", port=65535),
        external("Triton", {"completion": {**COMPLETION, "protocol": "TritonGenerate"}}),
        external("KServeV2", {"completion": {**COMPLETION, "protocol": "TritonGenerate"}}),
        external(None, {"completion": {**COMPLETION, "protocol": "OpenAI"}}, port=1024),
    ],
)
def test_good_values_are_admitted(wire: dict[str, Any]) -> None:
    stored = spec_of(wire).wire()["runtime"]
    assert {key: stored[key] for key in wire["runtime"]} == wire["runtime"]


# ------------------------------------------------------------------------- old manifests


def _pods_before() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = json.loads(GOLDEN.read_text())
    return cases


@pytest.mark.parametrize("case", sorted(_pods_before()))
def test_an_old_manifest_renders_the_same_pod_as_before(case: str) -> None:
    """The golden pods were rendered by the operator before runtime.protocol existed (commit
    3b16418, with test_pods' name, namespace, uid and replica 0 as Source), from each manifest
    as that CRD stored it (its defaults filled in): the same pod, plan digest included, so an
    upgrade replaces no replica. Deliberate differences, none part of the plan or the identity
    (running pods are kept, only new ones carry them): an External server's pod gained a
    startupProbe (a stock vLLM opens its port only once loaded), and every pod the
    inference-probe readiness gate and, handed its weights (replica 0 is a Source), the serving
    label (issue 45), and the pod template revision label (running pods without it are adopted,
    not rolled: test_planning_template)."""
    golden = _pods_before()[case]
    spec = spec_of(golden["stored"])
    pod = render(spec)
    assert pod["metadata"]["labels"].pop(TEMPLATE_LABEL) == pod_template_revision(spec)
    startup = container(pod).pop("startupProbe", None)
    assert (startup is not None) == case.startswith("external"), startup
    assert pod == golden["pod"]
