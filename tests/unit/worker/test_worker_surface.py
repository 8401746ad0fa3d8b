"""The worker's HTTP surface: P2P only with the peer token, bounded bodies (413), and a status
that never shows a secret. Against the real aiohttp app on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.worker import make_plan
from weightlift.worker.peer_auth import RedactingFilter, auth_headers, redact
from weightlift.worker.server import (
    MAX_SMALL_REQUEST_BYTES,
    MAX_TEXT_REQUEST_BYTES,
    WorkerState,
    build_app,
    set_p2p_handler,
)

TOKEN = "tok-0123456789abcdef-secret"


class EchoPublisher:
    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return web.json_response({"tail": request.match_info["tail"], "bytes": len(body)})


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[WorkerState, str]]:
    state = WorkerState.for_plan(make_plan(tmp_path))
    state.peer_token = TOKEN
    app = build_app(state)
    set_p2p_handler(app, EchoPublisher())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield state, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_p2p_needs_the_peer_token(served: tuple[WorkerState, str]) -> None:
    _, url = served
    manifest = f"{url}/weightlift/v1/p2p/manifest?rank=0&identity=id-123"
    async with httpx.AsyncClient() as client:
        missing = await client.get(manifest)
        assert missing.status_code == 401
        assert missing.headers["WWW-Authenticate"].startswith("Bearer")
        wrong = await client.get(manifest, headers=auth_headers("tok-wrong"))
        assert wrong.status_code == 403 and "wrong peer token" in wrong.text
        basic = await client.get(manifest, headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401
        for path in ("health", "sessions/x"):
            refused = await client.delete(f"{url}/weightlift/v1/p2p/{path}")
            assert refused.status_code == 401
        ok = await client.get(manifest, headers=auth_headers(TOKEN))
        assert ok.status_code == 200 and ok.json()["tail"] == "manifest"
        # Everything else stays open: the kubelet's probes and the operator's status read.
        assert (await client.get(f"{url}/v2/health/live")).status_code == 200
        assert (await client.get(f"{url}/weightlift/v1/status")).status_code == 200


async def test_without_a_token_p2p_is_open(served: tuple[WorkerState, str]) -> None:
    state, url = served
    state.peer_token = None
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/weightlift/v1/p2p/health")).status_code == 200


async def test_bodies_over_the_route_limit_get_413(served: tuple[WorkerState, str]) -> None:
    _, url = served
    auth = auth_headers(TOKEN)
    async with httpx.AsyncClient() as client:
        small = b"x" * (MAX_SMALL_REQUEST_BYTES - 1)
        ok = await client.post(f"{url}/weightlift/v1/p2p/sessions", content=small, headers=auth)
        assert ok.status_code == 200 and ok.json()["bytes"] == len(small)
        big = small + b"xx"
        r = await client.post(f"{url}/weightlift/v1/p2p/sessions", content=big, headers=auth)
        assert r.status_code == 413
        assert f"{MAX_SMALL_REQUEST_BYTES}-byte limit of /weightlift/v1/p2p/sessions" in r.text

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while reading
            for _ in range(3):
                yield b"y" * MAX_SMALL_REQUEST_BYTES

        r = await client.post(f"{url}/weightlift/v1/p2p/sessions", content=chunks(), headers=auth)
        assert r.status_code == 413 and "exceeds" in r.json()["error"]
        text = b"z" * (MAX_TEXT_REQUEST_BYTES + 1)
        r = await client.post(f"{url}/v2/models/demo/generate", content=text)
        assert r.status_code == 413 and "/v2/models/demo/generate" in r.json()["error"]
        r = await client.post(f"{url}/v1/completions", content=text)
        assert r.status_code == 413
        # infer takes tensors: a body over the small limit is still read (and judged on its own)
        r = await client.post(f"{url}/v2/models/demo/infer", content=small + b"xx")
        assert r.status_code == 503  # not loaded: the body limit did not answer


async def test_the_status_never_shows_a_secret(served: tuple[WorkerState, str]) -> None:
    state, url = served
    state.secrets = [TOKEN]
    state.report.message = f"peer said: bad header Authorization: Bearer {TOKEN}"
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"{url}/weightlift/v1/status")).text
    assert TOKEN not in body and "<redacted>" in body


def test_log_records_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("test.redact")
    secret_filter = RedactingFilter({"WEIGHTLIFT_PEER_TOKEN": TOKEN, "HF_TOKEN": "short"})
    caplog.handler.addFilter(secret_filter)
    try:
        logger.warning("header was %s", f"Bearer {TOKEN}")
    finally:
        caplog.handler.removeFilter(secret_filter)
    assert TOKEN not in caplog.text and "Bearer <redacted>" in caplog.text
    assert redact("short stays", secret_filter.secrets) == "short stays"  # too short to search
