"""Count every Kubernetes API request the operator makes, each attempt, by verb, resource and
HTTP code, in the API server's own vocabulary (its audit log's verbs and resources, as
`bench/apiaudit.py` reads them): 429s and retries included.

Two clients talk to the API server: the kubernetes client (our writes, kube.py), counted at its
urllib3 pool (below the client's own retries of 429s), and kopf (watches, its annotations and
finalizers), counted by an aiohttp trace on its session. kopf has no hook for that: its
session is made in `APIContext.__init__`, wrapped here as watchtrim.py wraps its watch. If a
kopf release moves it, the operator runs uncounted by kopf (logged) and test_apicalls fails.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
from kopf._cogs.clients import auth
from kubernetes import client

from weightlift.operator.metrics import METRICS, Metrics

log = logging.getLogger(__name__)

ERROR_CODE = "<error>"  # no answer (connection refused, timeout), as controller-runtime says
NON_RESOURCE = "nonresource"  # discovery (/api, /apis/<group>/<version>), /version, ...
_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def _segment(part: str) -> str:
    return part if _NAME.fullmatch(part) else "other"


def classify(method: str, url: str) -> tuple[str, str]:
    """(verb, resource[/subresource]) of a request, e.g. ("patch", "modeldeployments/status").
    Names and namespaces are dropped: only the API's own words remain (a bounded set)."""
    parts = urlsplit(url)
    path = [p for p in parts.path.split("/") if p]
    query = parse_qs(parts.query)
    watch = query.get("watch", [""])[0].lower() in ("true", "1")
    if path[:1] == ["api"] and len(path) >= 2:
        rest = path[2:]
    elif path[:1] == ["apis"] and len(path) >= 3:
        rest = path[3:]
    else:
        return method.lower(), NON_RESOURCE
    if rest[:1] == ["watch"]:  # the old /watch/ paths
        watch, rest = True, rest[1:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]  # namespaced: drop namespaces/<ns>
    if not rest:
        return "get", NON_RESOURCE
    resource = _segment(rest[0]) + (f"/{_segment(rest[2])}" if len(rest) > 2 else "")
    named = len(rest) > 1
    method = method.upper()
    if method == "GET":
        verb = "watch" if watch else ("get" if named else "list")
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    return verb, resource


def record(
    metrics: Metrics, who: str, method: str, url: str, code: int | None, seconds: float | None
) -> None:
    verb, resource = classify(method, url)
    label = str(code) if code else ERROR_CODE
    metrics.api_requests.labels(client=who, verb=verb, resource=resource, code=label).inc()
    if seconds is not None and verb != "watch":
        metrics.api_duration.labels(client=who, verb=verb, resource=resource).observe(seconds)


# ----------------------------------------------------------------------- the kubernetes client
def instrument_client(api: client.ApiClient, metrics: Metrics = METRICS) -> None:
    """Count each HTTP request of `api` (once: a second call does nothing)."""
    pool = api.rest_client.pool_manager
    if getattr(pool.request, "counts_requests", False):
        return
    pool.request = _counted(pool.request, metrics)  # type: ignore[method-assign]


def _counted(send: Callable[..., Any], metrics: Metrics) -> Callable[..., Any]:
    @functools.wraps(send)
    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            response = send(method, url, *args, **kwargs)
        except Exception:
            record(metrics, "kubernetes", method, url, None, None)
            raise
        record(metrics, "kubernetes", method, url, response.status, time.monotonic() - started)
        return response

    request.counts_requests = True  # type: ignore[attr-defined]
    return request


# ------------------------------------------------------------------------------------- kopf
def trace_config(metrics: Metrics = METRICS) -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()

    async def start(_: Any, ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams) -> None:
        ctx.started = time.monotonic()

    async def end(_: Any, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams) -> None:
        seconds = time.monotonic() - getattr(ctx, "started", time.monotonic())
        record(metrics, "kopf", params.method, str(params.url), params.response.status, seconds)

    async def failed(
        _: Any, ctx: SimpleNamespace, params: aiohttp.TraceRequestExceptionParams
    ) -> None:
        record(metrics, "kopf", params.method, str(params.url), None, None)

    trace.on_request_start.append(start)
    trace.on_request_end.append(end)
    trace.on_request_exception.append(failed)
    trace.freeze()
    return trace


def install_kopf(metrics: Metrics = METRICS) -> bool:
    """Trace every session kopf makes; False when this kopf has no APIContext to wrap."""
    init = getattr(getattr(auth, "APIContext", None), "__init__", None)
    if init is None:
        log.warning("kopf has no auth.APIContext: its API requests are not counted")
        return False
    if getattr(init, "counts_requests", False):
        return True
    trace = trace_config(metrics)

    @functools.wraps(init)
    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # aiohttp returns its own list: a config appended is used by every later request.
        self.session.trace_configs.append(trace)

    traced_init.counts_requests = True  # type: ignore[attr-defined]
    auth.APIContext.__init__ = traced_init  # type: ignore[method-assign]
    return True
