"""The front door against the Open Inference Protocol REST spec (open_inference_rest.yaml):
`/v2/` is server metadata as `/v2` is, a method a route does not declare is a 405 naming the
declared ones in Allow, an unknown path a 404. Against the real aiohttp app on a loopback port,
with no engine: the router answers these before any handler runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.worker import make_plan
from weightlift.worker.server import WorkerState, build_app

GET = {"GET", "HEAD"}  # aiohttp answers HEAD on every GET route
POST = {"POST"}
Client = TestClient[web.Request, web.Application]


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    app = build_app(WorkerState.for_plan(make_plan(tmp_path)))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


def allowed(header: str) -> set[str]:
    return {m.strip() for m in header.split(",") if m.strip()}


async def test_v2_with_a_slash_is_server_metadata(client: Client) -> None:
    bare = await client.get("/v2")
    slash = await client.get("/v2/")
    assert bare.status == slash.status == 200
    assert await slash.json() == await bare.json()
    assert set((await slash.json())["extensions"]) >= {"binary_tensor_data"}
    head = await client.head("/v2/")
    assert head.status == 200 and await head.read() == b""


@pytest.mark.parametrize(
    ("method", "path", "declared"),
    [
        ("DELETE", "/v2/health/ready", GET),
        ("POST", "/v2/health/live", GET),
        ("PUT", "/v2/models/demo/infer", POST),
        ("GET", "/v2/models/demo/versions/1/infer", POST),
        ("DELETE", "/v2/models/demo/generate", POST),
        ("PATCH", "/v2/models/demo", GET),
        ("PUT", "/v2/models/demo/versions/1/ready", GET),
        ("POST", "/v2", GET),
        ("DELETE", "/v2/", GET),
        # OPTIONS is not declared either: a 405 whose Allow answers what OPTIONS would.
        ("OPTIONS", "/v2/health/live", GET),
    ],
)
async def test_an_undeclared_method_is_405_with_allow(
    client: Client, method: str, path: str, declared: set[str]
) -> None:
    r = await client.request(method, path)
    assert r.status == 405, (method, path, r.status)
    assert allowed(r.headers["Allow"]) == declared


async def test_head_answers_on_get_routes(client: Client) -> None:
    for path in ("/v2", "/v2/health/live", "/v2/health/ready"):
        r = await client.head(path)
        assert r.status in (200, 503), (path, r.status)  # ready is 503 until the model serves
        assert await r.read() == b""


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/nope"),
        ("DELETE", "/v2/nope"),
        ("GET", "/v3"),
        ("GET", "/v2/models/demo/explain"),
        # The spec writes these without a slash: only /v2/ gains one.
        ("GET", "/v2/health/live/"),
        ("POST", "/v2/models/demo/infer/"),
    ],
)
async def test_an_unknown_path_is_404(client: Client, method: str, path: str) -> None:
    r = await client.request(method, path)
    assert r.status == 404, (method, path, r.status)
    assert "Allow" not in r.headers
