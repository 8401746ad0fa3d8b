"""The worker's front door (aiohttp): KServe v2 / Triton HTTP, Prometheus, weightlift status.

Routes: GET /v2 (and /v2/, as the Open Inference Protocol spec writes it), /v2/health/live,
/v2/health/ready, /v2/models/{m}[/versions/{v}], /v2/models/{m}[/versions/{v}]/ready,
POST /v2/models/{m}[/versions/{v}]/infer and /generate (Triton's generate extension), any method
on /v1/{tail} (the OpenAI API), GET /metrics, GET /weightlift/v1/status (the WorkerReport JSON),
and any method on /weightlift/v1/p2p/{tail}, forwarded to the P2P source publisher's
`handle(request)` once one is installed with `set_p2p_handler(app, publisher)` (503 "not a source
yet" before). The model routes belong to the engine in `state.engine` (worker/engines: builtin
answers infer, vLLM generate and /v1, Triton infer and generate; an engine's `metrics_text()`, if
it has one, follows /metrics: vLLM's `vllm:*` or Triton's `nv_*`, labelled with the replica, see
engines/exposition.py); infer and generate answer only once the replica is Ready. A method
a route does not declare gets the router's 405 with an Allow header (no catch-all covers /v2), an
unknown path a 404. The handlers live in the WorkerState (mutable) rather than as app keys:
aiohttp deprecates changing a started app.

Every request body is bounded per route (`body_limit`): more is refused with a 413 naming the
limit. The P2P routes answer only requests bearing the model identity's peer token
(peer_auth.py). The status never carries secret env values (redacted from its messages).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from weightlift.api.worker import WorkerPhase, WorkerPlan, WorkerReport
from weightlift.worker.peer_auth import peer_token, redact, refusal, secret_values
from weightlift.worker.weights.progress import LoadProgress

# Request body limits: tensors for infer, a prompt (or chat) for generate and the OpenAI API,
# small JSON for P2P sessions and everything else.
MAX_REQUEST_BYTES = 256 << 20
MAX_TEXT_REQUEST_BYTES = 8 << 20
MAX_SMALL_REQUEST_BYTES = 64 << 10


class P2PHandler(Protocol):
    async def handle(self, request: web.Request) -> web.StreamResponse: ...


class EngineFront(Protocol):
    """What the front door asks of the engine serving the model (worker/engines/base.py has
    the whole interface): each model route is the engine's; one it does not serve is a 404
    naming why."""

    def metadata(self) -> dict[str, Any] | None:
        """The model's KServe v2 metadata; None while it is not loaded."""
        ...

    async def infer(self, request: web.Request) -> web.StreamResponse: ...

    async def generate(self, request: web.Request) -> web.StreamResponse: ...

    async def openai(self, request: web.Request) -> web.StreamResponse: ...


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.load_seconds = Gauge(
            "weightlift_load_seconds", "Seconds the weight load took", registry=r
        )
        self.bytes_loaded = Gauge("weightlift_bytes_loaded", "Weight bytes loaded", registry=r)
        self.bytes_total = Gauge("weightlift_bytes_total", "Weight bytes to load", registry=r)
        self.gbps = Gauge("weightlift_load_gbps", "Load throughput in GB/s", registry=r)
        self.ready = Gauge("weightlift_ready", "1 when the model serves", registry=r)
        self.requests = Counter(
            "weightlift_inference_requests", "Inference requests", ["model", "status"], registry=r
        )
        self.latency = Histogram(
            "weightlift_inference_seconds", "Inference latency", ["model"], registry=r
        )


@dataclass
class WorkerState:
    """Everything the server shows; the worker flow mutates it."""

    plan: WorkerPlan
    report: WorkerReport
    progress: dict[int, LoadProgress] = field(default_factory=dict)
    ready: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    # The P2P source publisher (anything with `async handle(request)`), None until published.
    p2p: P2PHandler | None = None
    # The engine serving the model (builtin, vLLM), None until the worker creates it.
    engine: EngineFront | None = None
    infer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The bearer token P2P clients must present (None: open; see peer_auth.py).
    peer_token: str | None = field(default_factory=peer_token)
    secrets: list[str] = field(default_factory=secret_values)

    @classmethod
    def for_plan(cls, plan: WorkerPlan) -> WorkerState:
        report = WorkerReport(
            model=plan.served_model_name,
            model_identity=plan.model_identity,
            role=str(plan.role),
            ranks=list(plan.ranks),
        )
        return cls(plan=plan, report=report)

    def snapshot(self) -> WorkerReport:
        """The report with live progress summed over local ranks."""
        rep = self.report
        if self.progress:
            ps = list(self.progress.values())
            rep.bytes_loaded = sum(p.bytes_loaded for p in ps)
            rep.bytes_total = sum(p.bytes_total for p in ps)
            secs = max(p.seconds for p in ps)
            rep.gbps = round(rep.bytes_loaded / secs / 1e9, 4) if secs > 0 else None
            if all(p.finished is not None for p in ps):
                rep.load_seconds = round(secs, 4)
            rep.load_phases = {
                k: round(max(p.phases.get(k, 0.0) for p in ps), 4)
                for k in dict.fromkeys(k for p in ps for k in p.phases)
            }
        return rep


STATE_KEY = web.AppKey("weightlift_state", WorkerState)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": message}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def set_p2p_handler(app: web.Application, handler: P2PHandler | None) -> None:
    """Install (or remove, with None) the handler of /weightlift/v1/p2p/{tail}."""
    app[STATE_KEY].p2p = handler


def body_limit(path: str) -> int:
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return MAX_REQUEST_BYTES
    if path.startswith("/v1/") or (path.startswith("/v2/models/") and path.endswith("/generate")):
        return MAX_TEXT_REQUEST_BYTES
    return MAX_SMALL_REQUEST_BYTES


def _too_large(path: str, size: int | None, limit: int) -> web.Response:
    got = f"{size} bytes" if size is not None else "more"
    return _error(f"request body of {got} exceeds the {limit}-byte limit of {path}", 413)


@web.middleware
async def bounded_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a body over the route's limit: at once by Content-Length, else while reading."""
    limit = body_limit(request.path)
    if request.content_length is not None and request.content_length > limit:
        return _too_large(request.path, request.content_length, limit)
    try:
        return await handler(request.clone(client_max_size=limit))
    except web.HTTPRequestEntityTooLarge:
        return _too_large(request.path, None, limit)


class FrontDoor:
    """The route handlers, over one WorkerState."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.name = state.plan.served_model_name

    def engine_or_error(self, request: web.Request) -> web.Response | EngineFront:
        m = request.match_info["model"]
        if m != self.name:
            return _error(f"unknown model {m!r} (this worker serves {self.name!r})", 404)
        v = request.match_info.get("version")
        if v is not None and v != "1":
            return _error(f"unknown version {v!r} of model {m!r}", 404)
        if self.state.engine is None:
            return _error(f"model {m!r} is not loaded yet (phase {self.state.report.phase})", 503)
        return self.state.engine

    async def server_meta(self, request: web.Request) -> web.Response:
        return _json(
            {"name": "weightlift", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
        )

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        return _json({"ready": self.state.ready}, 200 if self.state.ready else 503)

    async def model_meta(self, request: web.Request) -> web.Response:
        engine = self.engine_or_error(request)
        if isinstance(engine, web.Response):
            return engine
        meta = engine.metadata()
        if meta is None:
            m = request.match_info["model"]
            return _error(f"model {m!r} is not loaded yet (phase {self.state.report.phase})", 503)
        return _json(meta)

    async def model_ready(self, request: web.Request) -> web.Response:
        engine = self.engine_or_error(request)
        if isinstance(engine, web.Response) and engine.status != 503:
            return engine
        return _json(
            {"name": self.name, "ready": self.state.ready}, 200 if self.state.ready else 503
        )

    def when_ready(self, request: web.Request) -> web.Response | EngineFront:
        """The engine for a model route that needs the model Ready, else the refusal."""
        engine = self.engine_or_error(request)
        if isinstance(engine, web.Response):
            return engine
        if not self.state.ready:
            self.state.metrics.requests.labels(self.name, "unavailable").inc()
            rep = self.state.report
            why = f": {rep.message}" if rep.phase == WorkerPhase.FAILED and rep.message else ""
            return _error(f"model {self.name!r} is not ready (phase {rep.phase}){why}", 503)
        return engine

    async def infer(self, request: web.Request) -> web.StreamResponse:
        engine = self.when_ready(request)
        if isinstance(engine, web.Response):
            return engine
        return await engine.infer(request)

    async def metrics(self, request: web.Request) -> web.Response:
        rep = self.state.snapshot()
        m = self.state.metrics
        m.bytes_loaded.set(rep.bytes_loaded)
        m.bytes_total.set(rep.bytes_total)
        m.gbps.set(rep.gbps or 0.0)
        m.load_seconds.set(rep.load_seconds or 0.0)
        m.ready.set(1 if self.state.ready else 0)
        body = generate_latest(m.registry)
        engine_metrics = getattr(self.state.engine, "metrics_text", None)
        if engine_metrics is not None:  # the engine's own families (vllm:*, nv_*) follow ours
            body += (await engine_metrics()).encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        doc = self.state.snapshot().wire()
        if self.state.secrets:  # messages quote exceptions; none may quote a secret
            doc = json.loads(redact(json.dumps(doc), self.state.secrets))
        return _json(doc)

    async def p2p(self, request: web.Request) -> web.StreamResponse:
        denied = refusal(request, self.state.peer_token)
        if denied is not None:
            return denied
        handler = self.state.p2p
        if handler is None:
            return _error("not a source yet", 503)
        return await handler.handle(request)

    async def openai(self, request: web.Request) -> web.StreamResponse:
        engine = self.state.engine
        if engine is None:
            return _error(
                f"model {self.name!r} is not loaded yet (phase {self.state.report.phase})", 503
            )
        if not self.state.ready:  # closed until the verified weights are in
            return _error(f"the OpenAI API is not ready (phase {self.state.report.phase})", 503)
        return await engine.openai(request)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self.when_ready(request)
        if isinstance(engine, web.Response):
            return engine
        return await engine.generate(request)


def build_app(state: WorkerState) -> web.Application:
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[bounded_bodies])
    app[STATE_KEY] = state
    door = FrontDoor(state)
    r = app.router
    # The OIP REST spec writes server metadata as `/v2/`; KServe and Triton clients call `/v2`.
    for root in ("/v2", "/v2/"):
        r.add_get(root, door.server_meta)
    r.add_get("/v2/health/live", door.live)
    r.add_get("/v2/health/ready", door.ready)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(base, door.model_meta)
        r.add_get(base + "/ready", door.model_ready)
        r.add_post(base + "/infer", door.infer)
        r.add_post(base + "/generate", door.generate)
    r.add_get("/metrics", door.metrics)
    r.add_get("/weightlift/v1/status", door.status)
    r.add_route("*", "/weightlift/v1/p2p/{tail:.*}", door.p2p)
    r.add_route("*", "/v1/{tail:.*}", door.openai)
    return app
