"""The worker's HTTP server (aiohttp): KServe v2 / Triton HTTP, Prometheus, weightlift status.

Routes: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{m}[/versions/{v}],
/v2/models/{m}[/versions/{v}]/ready, POST /v2/models/{m}[/versions/{v}]/infer (JSON tensors and
the binary tensor data extension, as tritonclient.http sends by default), GET /metrics,
GET /weightlift/v1/status (the WorkerReport JSON), and any method on /weightlift/v1/p2p/{tail},
forwarded to the P2P source publisher's `handle(request)` once one is installed with
`set_p2p_handler(app, publisher)` (503 "not a source yet" before). With an engine (vLLM) in
`state.engine`: any method on /v1/{tail} is forwarded to it and POST /v2/models/{m}/generate
(Triton's generate extension) is answered through it; without one those answer 404. The
handlers live in the WorkerState (mutable) rather than as app keys: aiohttp deprecates changing
a started app.

Every request body is bounded per route (`body_limit`): more is refused with a 413 naming the
limit. The P2P routes answer only requests bearing the model identity's peer token
(peer_auth.py). The status never carries secret env values (redacted from its messages).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from weightlift.api.worker import WorkerPlan, WorkerReport
from weightlift.worker.peer_auth import peer_token, redact, refusal, secret_values
from weightlift.worker.runtime import V2_TO_NUMPY, InferError, Pt2Runtime
from weightlift.worker.weights.progress import LoadProgress

HEADER_LEN = "Inference-Header-Content-Length"
# Request body limits: tensors for infer, a prompt (or chat) for generate and the OpenAI API,
# small JSON for P2P sessions and everything else.
MAX_REQUEST_BYTES = 256 << 20
MAX_TEXT_REQUEST_BYTES = 8 << 20
MAX_SMALL_REQUEST_BYTES = 64 << 10
NUMPY_TO_V2 = {np.dtype(v).str: k for k, v in V2_TO_NUMPY.items()}


class P2PHandler(Protocol):
    async def handle(self, request: web.Request) -> web.StreamResponse: ...


class EngineFront(Protocol):
    """A model engine the worker runs beside itself (vLLM): its URL and text generation."""

    url: str

    async def forward(self, request: web.Request, base: str) -> web.StreamResponse: ...

    async def generate(self, request: web.Request) -> web.Response: ...


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
    runtime: Pt2Runtime | None = None
    ready: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    # The P2P source publisher (anything with `async handle(request)`), None until published.
    p2p: P2PHandler | None = None
    # The engine serving the model when it is not the builtin runtime (vLLM), else None.
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


def _decode_inputs(
    body: bytes, header_len: int | None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if header_len is not None:
        if header_len < 0 or header_len > len(body):
            raise InferError(f"{HEADER_LEN} {header_len} exceeds the body ({len(body)} bytes)")
        head, binary = body[:header_len], body[header_len:]
    else:
        head, binary = body, b""
    try:
        req = json.loads(head)
    except ValueError as exc:
        raise InferError(f"request is not JSON: {exc}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise InferError("request must be an object with an 'inputs' list")
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for item in req["inputs"]:
        if not isinstance(item, dict):
            raise InferError("each input must be an object")
        name, dt, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(shape, list):
            raise InferError("each input needs 'name' and 'shape'")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InferError(f"input {name!r}: invalid shape {shape!r}")
        np_dtype = V2_TO_NUMPY.get(str(dt))
        if np_dtype is None:
            raise InferError(f"input {name!r}: unsupported datatype {dt!r}")
        numel = int(np.prod(shape)) if shape else 1
        params = item.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        try:
            if size is not None:
                if not isinstance(size, int) or size < 0 or pos + size > len(binary):
                    raise InferError(f"input {name!r}: binary_data_size {size!r} is out of range")
                want = numel * np.dtype(np_dtype).itemsize
                if size != want:
                    raise InferError(f"input {name!r}: {size} binary bytes, shape needs {want}")
                arr = np.frombuffer(binary[pos : pos + size], dtype=np_dtype).reshape(shape)
                pos += size
            else:
                if "data" not in item:
                    raise InferError(f"input {name!r} has neither 'data' nor binary data")
                arr = np.asarray(item["data"], dtype=np_dtype)
                if arr.size != numel:
                    raise InferError(
                        f"input {name!r}: {arr.size} values, shape {shape} needs {numel}"
                    )
                arr = arr.reshape(shape)
        except (TypeError, ValueError) as exc:
            raise InferError(f"input {name!r}: {exc}") from None
        arrays[name] = arr
    return req, arrays


def _encode_outputs(
    model: str, req: dict[str, Any], outputs: dict[str, np.ndarray]
) -> web.Response:
    params = req.get("parameters") if isinstance(req.get("parameters"), dict) else {}
    default_binary = bool(params.get("binary_data_output", False)) if params else False
    wanted: dict[str, bool] = {}
    requested = req.get("outputs")
    if isinstance(requested, list) and requested:
        for o in requested:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InferError("each requested output needs a 'name'")
            if o["name"] not in outputs:
                raise InferError(f"unknown output {o['name']!r}")
            p = o.get("parameters") if isinstance(o.get("parameters"), dict) else {}
            wanted[o["name"]] = bool((p or {}).get("binary_data", default_binary))
    else:
        wanted = {n: default_binary for n in outputs}
    out_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in wanted.items():
        arr = outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": NUMPY_TO_V2.get(arr.dtype.str, "FP32"),
            "shape": list(arr.shape),
        }
        if binary:
            raw = np.ascontiguousarray(arr).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.flatten().tolist()
        out_json.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": out_json}
    if "id" in req:
        doc["id"] = req["id"]
    head = json.dumps(doc).encode()
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    resp = web.Response(body=head + b"".join(blobs), content_type="application/octet-stream")
    resp.headers[HEADER_LEN] = str(len(head))
    return resp


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


def build_app(state: WorkerState) -> web.Application:
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[bounded_bodies])
    app[STATE_KEY] = state
    name = state.plan.served_model_name

    def model_or_error(request: web.Request) -> web.Response | Pt2Runtime:
        m = request.match_info["model"]
        if m != name:
            return _error(f"unknown model {m!r} (this worker serves {name!r})", 404)
        v = request.match_info.get("version")
        if v is not None and v != "1":
            return _error(f"unknown version {v!r} of model {m!r}", 404)
        if state.runtime is None:
            return _error(f"model {m!r} is not loaded yet (phase {state.report.phase})", 503)
        return state.runtime

    async def server_meta(request: web.Request) -> web.Response:
        return _json(
            {"name": "weightlift", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
        )

    async def live(request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(request: web.Request) -> web.Response:
        return _json({"ready": state.ready}, 200 if state.ready else 503)

    async def model_meta(request: web.Request) -> web.Response:
        rt = model_or_error(request)
        if isinstance(rt, web.Response):
            return rt
        return _json(rt.metadata(name))

    async def model_ready(request: web.Request) -> web.Response:
        rt = model_or_error(request)
        if isinstance(rt, web.Response) and rt.status != 503:
            return rt
        return _json({"name": name, "ready": state.ready}, 200 if state.ready else 503)

    async def infer(request: web.Request) -> web.Response:
        rt = model_or_error(request)
        if isinstance(rt, web.Response):
            return rt
        if not state.ready:
            state.metrics.requests.labels(name, "unavailable").inc()
            return _error(f"model {name!r} is not ready (phase {state.report.phase})", 503)
        t0 = time.perf_counter()
        try:
            body = await request.read()
            hl = request.headers.get(HEADER_LEN)
            try:
                header_len = int(hl) if hl is not None else None
            except ValueError:
                raise InferError(f"{HEADER_LEN} is not an integer: {hl!r}") from None
            req, arrays = _decode_inputs(body, header_len)
            loop = asyncio.get_running_loop()
            async with state.infer_lock:
                outputs = await loop.run_in_executor(None, rt.infer, arrays)
            resp = _encode_outputs(name, req, outputs)
        except InferError as exc:
            state.metrics.requests.labels(name, "bad_request").inc()
            return _error(str(exc), 400)
        state.metrics.requests.labels(name, "ok").inc()
        state.metrics.latency.labels(name).observe(time.perf_counter() - t0)
        return resp

    async def metrics(request: web.Request) -> web.Response:
        rep = state.snapshot()
        m = state.metrics
        m.bytes_loaded.set(rep.bytes_loaded)
        m.bytes_total.set(rep.bytes_total)
        m.gbps.set(rep.gbps or 0.0)
        m.load_seconds.set(rep.load_seconds or 0.0)
        m.ready.set(1 if state.ready else 0)
        return web.Response(
            body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def status(request: web.Request) -> web.Response:
        doc = state.snapshot().wire()
        if state.secrets:  # messages quote exceptions; none may quote a secret
            doc = json.loads(redact(json.dumps(doc), state.secrets))
        return _json(doc)

    async def p2p(request: web.Request) -> web.StreamResponse:
        denied = refusal(request, state.peer_token)
        if denied is not None:
            return denied
        handler = state.p2p
        if handler is None:
            return _error("not a source yet", 503)
        return await handler.handle(request)

    async def openai(request: web.Request) -> web.StreamResponse:
        engine = state.engine
        if engine is None:
            return _error("this worker serves no OpenAI API (runtime.engine is Builtin)", 404)
        return await engine.forward(request, engine.url)

    async def generate(request: web.Request) -> web.StreamResponse:
        m = request.match_info["model"]
        if m != name:
            return _error(f"unknown model {m!r} (this worker serves {name!r})", 404)
        if state.engine is None:
            return _error(f"model {m!r} does not generate text (a builtin PT2 program)", 404)
        if not state.ready:
            return _error(f"model {m!r} is not ready (phase {state.report.phase})", 503)
        return await state.engine.generate(request)

    r = app.router
    r.add_get("/v2", server_meta)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(base, model_meta)
        r.add_get(base + "/ready", model_ready)
        r.add_post(base + "/infer", infer)
        r.add_post(base + "/generate", generate)
    r.add_get("/metrics", metrics)
    r.add_get("/weightlift/v1/status", status)
    r.add_route("*", "/weightlift/v1/p2p/{tail:.*}", p2p)
    r.add_route("*", "/v1/{tail:.*}", openai)
    return app
