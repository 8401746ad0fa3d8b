"""The operator's Prometheus metrics: one registry, the families, the label vocabularies.

Names follow Prometheus' rules (prefix `weightlift_`, base units, counters end in `_total`)
and controller-runtime's families where one fits (`*_reconcile_total`,
`*_reconcile_duration_seconds`). Every label value comes from a fixed vocabulary below: no pod
or deployment names, no URIs, no free text, so a cluster of any size has the same few series.

What happens to a replica (Ready, fallbacks, compile cache) is recorded by `transitions.py`
from the status transitions the operator writes, once each; this module only holds the
families and serves them (`serve`: prometheus-client's own HTTP server, in its own thread, so
a scrape never waits for the operator's event loop).
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from weightlift.api.model import Engine, ModelDeploymentSpec, Phase, RuntimeType
from weightlift.api.worker import WorkerPhase

CONTROLLER = "modeldeployment"  # controller-runtime's `controller` label

# The vocabularies. A value outside one is recorded as OTHER.
OTHER = "other"
REPLICA_PHASES = frozenset(
    {"Pending", "Scheduled", "Ready", "Failed", "Spare", *(str(p) for p in WorkerPhase)}
)
DEPLOYMENT_PHASES = frozenset(str(p) for p in Phase)
ENGINES = frozenset({*(str(e) for e in Engine), str(RuntimeType.EXTERNAL)})
STORAGE_SCHEMES = frozenset({"s3", "hf", "pvc", "hostpath", "file"})
# Why a Target planned to pull from peers loaded from storage instead.
FALLBACK_REASONS = frozenset({"wait_expired", "sources_gone", "peer_failed"})
COMPILE_CACHE_OUTCOMES = frozenset({"hit_peer", "hit_store", "miss", "none"})
HANDED = frozenset({"peers", "storage"})

# Seconds: a replica on CPU is Ready in seconds, a big model on GPUs in tens of minutes.
READY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# A pass is milliseconds unless it waits for API calls or probes.
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The kubelet projects a changed annotation within its sync period (up to ~1-2 min).
HANDOFF_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 300)
API_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def bounded(value: str | None, allowed: frozenset[str]) -> str:
    return value if value is not None and value in allowed else OTHER


def engine_of(spec: ModelDeploymentSpec) -> str:
    if spec.runtime.type == RuntimeType.EXTERNAL:
        return str(RuntimeType.EXTERNAL)
    return str(spec.runtime.engine)


def loaded_from_label(loaded_from: str | None) -> str:
    """`peer:<pod>` -> `peer`; `storage:<scheme>` keeps a known scheme; `cache`; ranks that
    loaded from different kinds (the worker joins them with commas): `mixed`."""
    if not loaded_from:
        return "unknown"
    kinds = {_one_source(part) for part in loaded_from.split(",") if part}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _one_source(loaded_from: str) -> str:
    kind, _, scheme = loaded_from.partition(":")
    if kind == "peer":
        return "peer"
    if kind == "cache" and not scheme:
        return "cache"
    if kind == "storage":
        return f"storage:{scheme}" if scheme in STORAGE_SCHEMES else "storage:other"
    return OTHER


def compile_cache_label(raw: str | None, loaded_from: str | None) -> str:
    """The worker's `compileCache` (hit (peer) | hit (store) | miss (<reason>) | none | ""
    before the engine says) as one of COMPILE_CACHE_OUTCOMES. A bare `hit` (older workers) by
    a replica that pulled from a peer is the peer's program; any other hit was found in a store
    that outlived replicas."""
    text = (raw or "").strip()
    if text.startswith("hit (peer)"):
        return "hit_peer"
    if text.startswith("hit ("):
        return "hit_store"
    if text.startswith("hit"):
        return "hit_peer" if loaded_from_label(loaded_from) == "peer" else "hit_store"
    if text.startswith("miss"):
        return "miss"
    return "none"


class Metrics:
    """Every family the operator exports, in its own registry (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        if process:  # CPU seconds, RSS, open fds, start time; the Python version
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        r = self.registry
        self.replicas = Gauge(
            "weightlift_replicas",
            "Worker replicas by phase (all deployments).",
            ["phase"],
            registry=r,
        )
        self.deployments = Gauge(
            "weightlift_deployments", "ModelDeployments by phase.", ["phase"], registry=r
        )
        self.time_to_ready = Histogram(
            "weightlift_replica_time_to_ready_seconds",
            "From a worker pod's creation to its first passing inference probe, once a replica.",
            ["role", "loaded_from", "engine"],
            buckets=READY_BUCKETS,
            registry=r,
        )
        self.standby_wait = Histogram(
            "weightlift_standby_wait_seconds",
            "How long a Target waited in Standby (the worker's timeline), by what it was handed.",
            ["handed"],
            buckets=READY_BUCKETS,
            registry=r,
        )
        self.handoff_latency = Histogram(
            "weightlift_handoff_latency_seconds",
            "From the operator's hand-off (the peers annotation written) to the worker seeing it.",
            ["handed"],
            buckets=HANDOFF_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "weightlift_storage_fallbacks",
            "Targets planned to pull from peers that loaded from storage, by reason.",
            ["reason"],
            registry=r,
        )
        self.compile_cache = Counter(
            "weightlift_compile_cache",
            "Replicas Ready, by where the engine's compiled program came from.",
            ["engine", "outcome"],
            registry=r,
        )
        self.probes = Counter("weightlift_probes", "Inference probes sent.", ["engine"], registry=r)
        self.probe_failures = Counter(
            "weightlift_probe_failures", "Inference probes that failed.", ["engine"], registry=r
        )
        self.reconciles = Counter(
            "weightlift_reconcile",
            "Reconcile passes, by result (success or error).",
            ["controller", "result"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "weightlift_reconcile_errors",
            "Reconcile passes that failed.",
            ["controller"],
            registry=r,
        )
        self.reconcile_duration = Histogram(
            "weightlift_reconcile_duration_seconds",
            "Seconds a reconcile pass took (its turn started).",
            ["controller"],
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.api_requests = Counter(
            "weightlift_api_requests",
            "Kubernetes API requests (each attempt), by client, verb, resource and HTTP code.",
            ["client", "verb", "resource", "code"],
            registry=r,
        )
        self.api_duration = Histogram(
            "weightlift_api_request_duration_seconds",
            "Seconds until the API server's answer began (watches excluded).",
            ["client", "verb", "resource"],
            buckets=API_BUCKETS,
            registry=r,
        )
        # Series of a fixed vocabulary start at 0 (Prometheus' advice): a dashboard's
        # `increase` or failure ratio then says 0, not "no data", until the first one happens.
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        for engine in ENGINES:
            self.probes.labels(engine=engine)
            self.probe_failures.labels(engine=engine)
        # So too the hand-off histograms: the first hand-offs often land in one pass, and a
        # series born with count 2 never shows an `increase` (the p90 panel stays empty).
        for handed in HANDED:
            self.standby_wait.labels(handed=handed)
            self.handoff_latency.labels(handed=handed)
        # Per deployment uid: its replicas' phases and its own phase, as last counted. The
        # gauges are their sums, moved by the difference (no collector walks a live dict).
        self._counted: dict[str, tuple[Tally[str], str]] = {}
        self._lock = threading.Lock()

    # -- gauges
    def count_phases(self, uid: str, replica_phases: Mapping[str, int], phase: str) -> None:
        new = Tally({bounded(p, REPLICA_PHASES): n for p, n in replica_phases.items()})
        deployment_phase = bounded(phase, DEPLOYMENT_PHASES)
        with self._lock:
            old, old_phase = self._counted.get(uid, (Tally(), ""))
            self._move(old, new, old_phase, deployment_phase)
            self._counted[uid] = (new, deployment_phase)

    def forget(self, uid: str) -> None:
        """A deployment this operator no longer reconciles leaves the gauges."""
        with self._lock:
            old, old_phase = self._counted.pop(uid, (Tally(), ""))
            self._move(old, Tally(), old_phase, "")

    def _move(self, old: Tally[str], new: Tally[str], old_phase: str, phase: str) -> None:
        for key in old.keys() | new.keys():
            if (delta := new[key] - old[key]) != 0:
                self.replicas.labels(phase=key).inc(delta)
        if old_phase != phase:
            if old_phase:
                self.deployments.labels(phase=old_phase).dec()
            if phase:
                self.deployments.labels(phase=phase).inc()

    # -- counters
    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason=bounded(reason, FALLBACK_REASONS)).inc()

    def probed(self, engine: str, passed: bool) -> None:
        label = bounded(engine, ENGINES)
        self.probes.labels(engine=label).inc()
        if not passed:
            self.probe_failures.labels(engine=label).inc()

    def reconciled(self, seconds: float, ok: bool) -> None:
        self.reconcile_duration.labels(controller=CONTROLLER).observe(seconds)
        self.reconciles.labels(controller=CONTROLLER, result="success" if ok else "error").inc()
        if not ok:
            self.reconcile_errors.labels(controller=CONTROLLER).inc()


# The operator process's metrics: what the API hooks, passes and /metrics share.
METRICS = Metrics()


def serve(host: str, port: int, metrics: Metrics = METRICS) -> WSGIServer:
    """/metrics (any path, as prometheus-client serves it) on host:port; `shutdown()` stops it."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server
