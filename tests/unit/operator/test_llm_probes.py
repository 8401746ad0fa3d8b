"""LLM probes (greedy completions over OpenAI /v1/completions and Triton generate) against a real
small HTTP server, and the API rules of the vLLM engine."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from weightlift.api.model import (
    CompletionProbe,
    InferenceProbe,
    ModelDeploymentSpec,
    RuntimeSpec,
)
from weightlift.operator.probes import WorkerClient, check_text, probe_inference

TEXT = "la\ufffdry~la memory"


class Fake:
    def __init__(self) -> None:
        self.text: Any = TEXT
        self.status = 200
        self.bodies: list[dict[str, Any]] = []


FAKE = web.AppKey("fake", Fake)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Fake]]:
    fake = Fake()
    app = web.Application()
    app[FAKE] = fake

    async def completions(request: web.Request) -> web.Response:
        fake.bodies.append(await request.json())
        if fake.status != 200:
            return web.json_response({"error": "no"}, status=fake.status)
        return web.json_response({"choices": [{"index": 0, "text": fake.text}]})

    async def generate(request: web.Request) -> web.Response:
        fake.bodies.append(await request.json())
        return web.json_response({"model_name": "llm", "text_output": fake.text})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v2/models/llm/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", fake
    finally:
        await runner.cleanup()


def probe(**completion: Any) -> InferenceProbe:
    return InferenceProbe.model_validate(
        {"completion": {"prompt": "hello world", "maxTokens": 8, **completion}}
    )


async def test_openai_completion_greedy_exact_text_passes(server: tuple[str, Fake]) -> None:
    address, fake = server
    async with WorkerClient() as client:
        result = await probe_inference(client, address, "llm", probe(expectedText=TEXT), None)
    assert result.passed, result.message
    assert fake.bodies == [
        {"model": "llm", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    ]


async def test_wrong_text_fails_naming_both_texts(server: tuple[str, Fake]) -> None:
    address, fake = server
    fake.text = "something else"
    async with WorkerClient() as client:
        result = await probe_inference(client, address, "llm", probe(expectedText=TEXT), None)
    assert not result.passed
    assert "something else" in result.message and repr(TEXT) in result.message


async def test_triton_generate_with_prefix(server: tuple[str, Fake]) -> None:
    address, fake = server
    p = probe(protocol="TritonGenerate", expectedPrefix="la")
    async with WorkerClient() as client:
        result = await probe_inference(client, address, "llm", p, None)
        assert result.passed, result.message
        fake.text = "xla"
        result = await probe_inference(client, address, "llm", p, None)
    assert not result.passed and "start with 'la'" in result.message
    assert fake.bodies[0] == {
        "text_input": "hello world",
        "parameters": {"max_tokens": 8, "temperature": 0},
    }


async def test_http_error_and_malformed_answers_fail_without_raising(
    server: tuple[str, Fake],
) -> None:
    address, fake = server
    async with WorkerClient() as client:
        fake.status = 503
        result = await probe_inference(client, address, "llm", probe(expectedText=TEXT), None)
        assert not result.passed and "HTTP 503" in result.message
        fake.status, fake.text = 200, None
        result = await probe_inference(client, address, "llm", probe(expectedText=TEXT), None)
    assert not result.passed and "no generated text" in result.message


def test_check_text_exact_and_prefix() -> None:
    exact = CompletionProbe(prompt="p", expected_text="ab")
    assert check_text("ab", exact) is None and check_text("abc", exact) is not None
    prefix = CompletionProbe(prompt="p", expected_prefix="ab")
    assert check_text("abc", prefix) is None and check_text("xab", prefix) is not None


def test_completion_probe_needs_exactly_one_expectation() -> None:
    with pytest.raises(ValidationError, match="exactly one of expectedText, expectedPrefix"):
        CompletionProbe(prompt="p")
    with pytest.raises(ValidationError, match="exactly one"):
        CompletionProbe(prompt="p", expected_text="a", expected_prefix="a")


def _spec(**runtime: Any) -> dict[str, Any]:
    return {
        "model": {"uri": "hostpath:///models/llama", "format": "safetensors"},
        "runtime": runtime,
    }


def test_vllm_engine_rules() -> None:
    spec = ModelDeploymentSpec.model_validate(
        _spec(engine="vLLM", engineArgs=["--max-model-len", "256"])
    )
    assert spec.runtime.engine == "vLLM" and spec.runtime.engine_port == 8001
    with pytest.raises(ValidationError, match=r"needs spec\.runtime\.engine vLLM"):
        ModelDeploymentSpec.model_validate(_spec())
    with pytest.raises(ValidationError, match=r"vLLM needs spec\.model\.format safetensors"):
        ModelDeploymentSpec.model_validate(
            {"model": {"uri": "hostpath:///m", "format": "pt2"}, "runtime": {"engine": "vLLM"}}
        )
    with pytest.raises(ValidationError, match="enginePort must differ"):
        RuntimeSpec(engine="vLLM", port=8001, engine_port=8001)
    with pytest.raises(ValidationError, match="not External"):
        RuntimeSpec(type="External", command=["x"], engine="vLLM")


async def test_a_completion_that_never_matches_keeps_the_replica_out_of_ready(
    server: tuple[str, Fake],
) -> None:
    """The probe's failure reaches the status: phase Probing (never Ready), a message naming the
    pod and both texts, and the replica is not a source."""
    from tests.support.planning import make_spec, mkpod, observe
    from weightlift.api.model import Phase, Role
    from weightlift.operator.planning import plan

    address, fake = server
    fake.text = "something else"
    async with WorkerClient() as client:
        result = await probe_inference(client, address, "llm", probe(expectedText=TEXT), None)
    spec = make_spec(
        1,
        uri="hostpath:///models/llama",
        fmt="safetensors",
        runtime={"engine": "vLLM"},
        probe={"completion": {"prompt": "hello world", "maxTokens": 8, "expectedText": TEXT}},
    )
    pod = mkpod(spec, 0, Role.SOURCE, state="loaded", probe=result)
    status = plan(spec, observe([pod])).status
    assert status.phase == Phase.PROBING and status.ready_replicas == 0
    assert pod.name in status.message and "something else" in status.message
    assert repr(TEXT) in status.message
    assert status.sources == [] and not status.replica_statuses[0].ready
