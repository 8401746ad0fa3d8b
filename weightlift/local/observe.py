"""Watching a ModelDeployment on the local stack: when each replica appeared, was scheduled and
got Ready, the worker's own timeline, and the inference calls the demo and tests make."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from weightlift.local.handoffwatch import HandoffWatch, handoff_seconds
from weightlift.local.kube import JSON
from weightlift.local.stack import LocalStack

log = logging.getLogger("weightlift.demo")

# --------------------------------------------------------------------------- observation


@dataclass
class ReplicaTimes:
    """What the demo saw of one pod, on the wall clock (the worker's timeline uses it too)."""

    first_seen: float
    scheduled_at: float | None = None
    ready_at: float | None = None


@dataclass
class Observer:
    """Polls a ModelDeployment and its pods; remembers when each pod appeared and got Ready."""

    stack: LocalStack
    name: str
    started: float = field(default_factory=time.monotonic)
    # Wall clock when watching began: made just before the apply, the zero of the times in
    # the summary (createdAt, standbyAt, readyAt).
    applied: float = field(default_factory=time.time)
    times: dict[str, ReplicaTimes] = field(default_factory=dict)
    md: JSON | None = None
    pods: list[JSON] = field(default_factory=list)
    ready_at: float | None = None
    # watch_handoffs(): when each target was handed its peers (the summary's handoffSeconds).
    handoffs: HandoffWatch | None = None

    def watch_handoffs(self) -> None:
        """Watch the pods' hand-off annotations from now on (before the apply); close() stops."""
        if self.handoffs is None:
            self.handoffs = HandoffWatch(self.stack.kube, self.stack.namespace, self.name)

    def close(self) -> None:
        if self.handoffs is not None:
            self.handoffs.close()

    def poll(self) -> JSON | None:
        now = time.monotonic()
        wall = time.time()
        self.md = self.stack.get_md(self.name)
        self.pods = self.stack.pods(self.name)
        for pod in self.pods:
            pod_name = pod["metadata"]["name"]
            seen = self.times.setdefault(pod_name, ReplicaTimes(first_seen=wall))
            if seen.scheduled_at is None and (pod.get("spec") or {}).get("nodeName"):
                seen.scheduled_at = wall
        for rs in self.replica_statuses():
            t = self.times.get(rs["name"])
            if t is not None and rs.get("ready") and t.ready_at is None:
                t.ready_at = wall
        if self.phase() == "Ready" and self.ready_at is None:
            self.ready_at = now
        return self.md

    def status(self) -> JSON:
        status: JSON = (self.md or {}).get("status", {}) or {}
        return status

    def phase(self) -> str:
        return str(self.status().get("phase", "Pending"))

    def replica_statuses(self) -> list[JSON]:
        rows: list[JSON] = self.status().get("replicaStatuses", []) or []
        return sorted(rows, key=lambda r: (r.get("replica", 0), r.get("name", "")))

    def condition(self, ctype: str) -> JSON | None:
        for c in self.status().get("conditions", []) or []:
            if c.get("type") == ctype:
                cond: JSON = c
                return cond
        return None

    def wait(
        self,
        predicate: Callable[[Observer], bool],
        timeout: float,
        what: str,
        tick: Callable[[Observer], None] | None = None,
        interval: float = 0.25,
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.stack.check_operator()
            self.poll()
            if tick is not None:
                tick(self)
            if predicate(self):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {timeout:.0f}s waiting for {what}; phase={self.phase()} "
                    f"message={self.status().get('message', '')!r}\n"
                    + "\n".join(
                        f"  {r.get('name')}: {r.get('role')} {r.get('phase')} "
                        f"ready={r.get('ready')} {r.get('message', '')}"
                        for r in self.replica_statuses()
                    )
                )
            time.sleep(interval)

    def wait_ready(self, timeout: float, tick: Callable[[Observer], None] | None = None) -> None:
        def ready(o: Observer) -> bool:
            desired = int(((o.md or {}).get("spec") or {}).get("replicas", 0))
            return (
                o.phase() == "Ready"
                and int(o.status().get("readyReplicas", 0)) >= desired
                and sum(1 for r in o.replica_statuses() if r.get("ready")) >= desired
            )

        self.wait(ready, timeout, f"{self.name} Ready", tick=tick)

    def summary(self) -> JSON:
        """The `--json` document."""
        pods_by_name = {p["metadata"]["name"]: p for p in self.pods}
        runtime = ((self.md or {}).get("spec") or {}).get("runtime") or {}
        engine_port = runtime.get("enginePort") if runtime.get("engine") == "vLLM" else None
        triton = runtime.get("engine") == "Triton"
        replicas = []
        for rs in self.replica_statuses():
            pod = pods_by_name.get(rs["name"], {})
            port = _container_port(pod)
            ip = rs.get("podIP") or (pod.get("status") or {}).get("podIP")
            t = self.times.get(rs["name"])
            worker = _worker_timeline(ip, port) if ip else {}
            replicas.append(
                {
                    "name": rs["name"],
                    "role": rs.get("role"),
                    "loadedFrom": rs.get("loadedFrom"),
                    "endpoint": f"http://{ip}:{port}" if ip else None,
                    "model": self.name,
                    **(
                        {
                            # The worker's /v1: vLLM's own port takes only the worker's key.
                            "openaiEndpoint": f"http://{ip}:{port}/v1" if ip else None,
                            "servedModelName": self.name,
                        }
                        if engine_port
                        else {}
                    ),
                    **(_triton_endpoints(runtime, ip, self.name) if triton else {}),
                    "hooksRun": rs.get("hooksRun"),
                    "loadSeconds": rs.get("loadSeconds"),
                    "gbps": rs.get("gbps"),
                    "compileCache": rs.get("compileCache"),
                    "bytesTotal": rs.get("bytesTotal"),
                    "ready": rs.get("ready"),
                    "secondsToReady": round(t.ready_at - t.first_seen, 3)
                    if t is not None and t.ready_at is not None
                    else None,
                    **self._moments(t, worker),
                    "timeline": replica_timeline(t, worker) if t is not None and ip else {},
                    # How each rank's weights moved from its peer, as UCX named it.
                    "transports": rs.get("transports") or [],
                }
            )
        return {
            "phase": self.phase(),
            "secondsToReady": round(self.ready_at - self.started, 3)
            if self.ready_at is not None
            else None,
            **standby_ratio(replicas),
            "replicas": replicas,
        }

    def _moments(self, seen: ReplicaTimes | None, worker: dict[str, float]) -> JSON:
        """createdAt, standbyAt (a Target that waited for peers) and readyAt: seconds since
        the apply (the demo's polls: 0.25 s resolution; standbyAt from the worker's clock)."""

        def since(at: float | None) -> float | None:
            return round(at - self.applied, 3) if at is not None else None

        moments: JSON = {
            "createdAt": since(seen.first_seen if seen else None),
            "readyAt": since(seen.ready_at if seen else None),
        }
        if "standby" in worker:
            moments["standbyAt"] = since(worker["standby"])
        if self.handoffs is not None and seen is not None:
            name = next((n for n, t in self.times.items() if t is seen), "")
            latency = handoff_seconds(self.handoffs.handed.get(name), worker)
            if latency is not None:  # annotation patch (its watch event) -> worker read it
                moments["handoffSeconds"] = latency
        return moments


def standby_ratio(replicas: list[JSON]) -> JSON:
    """When the first storage source and the whole deployment were Ready (seconds since the
    apply) and (deployment Ready - source Ready) / source Ready: what standby shortens."""
    sources = [
        r["readyAt"]
        for r in replicas
        if r.get("readyAt") is not None and not str(r.get("loadedFrom") or "").startswith("peer:")
    ]
    ready = [r.get("readyAt") for r in replicas]
    if not sources or not ready or any(at is None for at in ready):
        return {}
    source, everyone = min(sources), max(at for at in ready if at is not None)
    ratio = round((everyone - source) / source, 3) if source > 0 else None
    return {"sourceReadyAt": source, "readyAt": everyone, "afterSourceRatio": ratio}


# Where a replica's seconds went, in order: each step ends at the named mark. Marks from the
# demo's own polling (0.25 s resolution): created, scheduled, ready; from the worker's report:
# the rest (its process start, HTTP up, model fetched, hooks run, weights loaded, bound, serving).
# vLLM replicas: "engine" (vLLM started and initialized up to its weight load; it then runs the
# hooks and loads inside each rank) and "processed" (vLLM's load_weights and post-processing)
# instead of "bind"; steps a replica lacks are left out.
TIMELINE_STEPS = (
    ("scheduling", "scheduled"),
    ("process start", "process"),
    ("imports + server", "server"),
    ("fetch", "fetch"),
    ("engine start", "engine"),
    ("hooks", "hooks"),
    ("standby", "standby"),
    ("wait for peers", "peers"),
    ("load", "load"),
    ("bind", "bind"),
    ("vLLM processing", "processed"),
    ("serve", "serving"),
    ("probe", "ready"),
)


def replica_timeline(seen: ReplicaTimes, worker: dict[str, float]) -> dict[str, float]:
    """Seconds per step (TIMELINE_STEPS) for one replica; steps without both marks are left out."""
    marks: dict[str, float | None] = {
        "created": seen.first_seen,
        "scheduled": seen.scheduled_at,
        **worker,
        "ready": seen.ready_at,
    }
    out: dict[str, float] = {}
    prev = marks["created"]
    for step, mark in TIMELINE_STEPS:
        at = marks.get(mark)
        if at is None or prev is None:
            continue
        if at < prev - 0.5:
            # Out of order (a vLLM target waits for peers before its engine starts): folded
            # into the step that follows, so the steps still add up to created -> ready.
            continue
        out[step] = round(max(0.0, at - prev), 3)
        prev = max(prev, at)
    return out


def _worker_timeline(ip: str, port: int) -> dict[str, float]:
    try:
        r = httpx.get(f"http://{ip}:{port}/weightlift/v1/status", timeout=5.0)
        timeline = r.json().get("timeline") or {}
    except (httpx.HTTPError, ValueError):
        return {}
    return {str(k): float(v) for k, v in timeline.items()}


def _container_port(pod: JSON) -> int:
    for c in (pod.get("spec") or {}).get("containers", []):
        for p in c.get("ports", []):
            return int(p["containerPort"])
    return 8000


def _triton_endpoints(runtime: JSON, ip: str | None, model: str) -> JSON:
    """A Triton replica's own endpoints (its defaults as RuntimeSpec has them)."""
    if not ip:
        return {"tritonEndpoint": None, "modelName": model}
    return {
        "tritonEndpoint": f"http://{ip}:{runtime.get('enginePort', 8001)}",
        "tritonGrpcEndpoint": f"{ip}:{runtime.get('engineGrpcPort', 8003)}",
        "tritonMetrics": f"http://{ip}:{runtime.get('engineMetricsPort', 8002)}/metrics",
        "modelName": model,
    }


def generate(triton_endpoint: str, model: str, completion: JSON, timeout: float = 60.0) -> str:
    """Greedy text of a completion probe's prompt, from Triton's generate extension."""
    body = {
        "text_input": completion["prompt"],
        "parameters": {"max_tokens": completion["maxTokens"], "temperature": 0},
    }
    r = httpx.post(f"{triton_endpoint}/v2/models/{model}/generate", json=body, timeout=timeout)
    r.raise_for_status()
    text: str = r.json()["text_output"]
    return text


def infer(endpoint: str, model: str, request: JSON, timeout: float = 10.0) -> JSON:
    r = httpx.post(f"{endpoint}/v2/models/{model}/infer", json=request, timeout=timeout)
    r.raise_for_status()
    body: JSON = r.json()
    return body


def pod_vllm_dirs(pod: str, since: float = 0.0) -> list[Path]:
    """A process-node pod's vLLM directories (its log, its cache root), oldest first: its worker
    keeps vLLM's files in a new temp folder named after the pod (engines/vllm/engine.py,
    VllmEngine.for_worker) when WEIGHTLIFT_ENGINE_DIR is not set."""
    found = [
        p
        for p in Path(tempfile.gettempdir()).glob(f"wl-vllm-{pod}-*")
        if p.is_dir() and p.stat().st_mtime >= since
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def pod_vllm_log(pod: str, since: float) -> str:
    """The newest vLLM log of `pod` (pod_vllm_dirs) written since `since`."""
    found = [d / "vllm.log" for d in pod_vllm_dirs(pod)]
    found = [p for p in found if p.is_file() and p.stat().st_mtime >= since]
    if not found:
        raise FileNotFoundError(f"no vLLM log of {pod} under {tempfile.gettempdir()}")
    return max(found, key=lambda p: p.stat().st_mtime).read_text(errors="replace")


def complete(openai_base: str, model: str, completion: JSON, timeout: float = 60.0) -> str:
    """Greedy text of a completion probe's prompt, from an OpenAI /v1 endpoint."""
    body = {
        "model": model,
        "prompt": completion["prompt"],
        "max_tokens": completion["maxTokens"],
        "temperature": 0,
    }
    r = httpx.post(f"{openai_base}/completions", json=body, timeout=timeout)
    r.raise_for_status()
    text: str = r.json()["choices"][0]["text"]
    return text
