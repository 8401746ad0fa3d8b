"""What the operator keeps between passes: its clients and settings, one record per
ModelDeployment and one per pod. A deleted object's record goes with one `pop`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubernetes import client

from weightlift.api.labels import PEERS_ANNOTATION
from weightlift.api.model import DEFAULT_GPU_RESOURCE
from weightlift.api.worker import PeerHandoff
from weightlift.operator import kube
from weightlift.operator.metrics import METRICS, Metrics
from weightlift.operator.probes import ProbeResult, WorkerClient
from weightlift.operator.settings import Settings
from weightlift.operator.statuswrites import state_key

NODE_CACHE_SECONDS = 60.0
# How long a pass waits for pods it created to show up in kopf's pod index (the pod watch wakes
# the loop as soon as they do); after that the index is trusted again: kopf's watch can lag by
# more than 10 s under load, and planning without the pods would create them again (409s).
CREATED_POD_WAIT_SECONDS = 60.0
# Reconcile passes running at once; the other loops wait their turn (FIFO) before they read
# anything. A pass spends most of its time waiting for API threads (kube.API_THREADS) and probe
# slots (probes.MAX_WORKER_REQUESTS), which bound the throughput anyway. Unbounded, `bench
# operator -n 500` had ~410 passes in flight at once in its ramp, each holding its parsed spec,
# observed pods and plan (pydantic models: most of the operator's 29k live sets then); at -n 1000
# the bound took peak RSS from 217 to 196 MB and the operator's ramp CPU from 109 to 82 s.
MAX_PASSES = 64


@dataclass
class DeploymentRecord:
    """One ModelDeployment (by uid)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # The status this operator last planned (its JSON). The status is ours, and the live body
    # lags behind our own writes until the watch brings them back: planning against the lagging
    # copy would post the same phase Event twice. Kept as JSON, parsed when read (~50 us, twice
    # a pass): a Ready 4-replica status is ~20 KB of Python objects, its JSON 3.5 KB.
    status: bytes | None = None
    # The last write: when, and its state key (statuswrites.py); `pending` while the planned
    # status differs from the written one (a coalesced write not made yet).
    written_at: float | None = None
    written_key: str | None = None
    pending: bool = False
    error: str | None = None  # the last failed pass's error (one Event per new error)
    # Pods created by this operator that kopf's index has not shown yet: name -> give-up time.
    awaited: dict[str, float] = field(default_factory=dict)
    # Spares this operator woke whose spare label the index may still show: name -> give-up
    # time. A pass that took such a pod for a spare would wake one more.
    woken: dict[str, float] = field(default_factory=dict)
    # What exists beside the pods (shared_objects.py), created once per operator life: plan
    # ConfigMap names and the model identities whose token Secret exists.
    plan_maps: set[str] = field(default_factory=set)
    tokens: set[str] = field(default_factory=set)
    # Pods of two plans were seen: the older plan ConfigMaps are swept once only pods of the
    # current plan are left. The plan label last seen tells a new plan.
    stale_plans: bool = False
    plan_label: str | None = None
    generation: int | None = None  # metadata.generation the last pass planned for
    # LeaderWorkerSets (multi-pod replicas, one per group) this operator made: name -> when
    # (monotonic), until it deletes them.
    lws: dict[str, float] = field(default_factory=dict)
    # The Service manifest this operator last applied (JSON), once per operator life and on
    # each change of it; None: none applied (spec.service off, or not yet).
    service: str | None = None


@dataclass
class PodRecord:
    """One worker pod (by uid): its probe and report memory."""

    probe: tuple[float, ProbeResult] | None = None  # (monotonic time, result)
    # (monotonic time read, the report's JSON), while Serving. Kept as JSON and parsed when
    # reused: a parsed report is ~3.2 KB of Python objects (its fields-set alone 2 KB), the
    # JSON 0.4 KB, 11 MB less at 4000 pods; parsing it again costs ~3 us.
    report: tuple[float, bytes] | None = None
    failure_seen: datetime | None = None  # first seen failed
    # For the metrics (transitions.py): what it was last handed (peers | storage), the wall
    # time of that hand-off until the worker is seen to have it, and whether its time to Ready
    # was recorded.
    handed: str | None = None
    handed_at: float | None = None
    ready_counted: bool = False
    # The last metadata patch sent to the pod (labels and annotations, as JSON) and when a pass
    # may send it again. kopf's index lags our writes: a pass planning against the lagging copy
    # hands the same peers again (a second patch per Target in `bench operator`). Cleared once
    # the index shows the patch, so a later, real change to the same values is sent.
    sent: tuple[str, float] | None = None
    # The inference-probe gate status last written and until when a pass may not write it again
    # (the index lags our writes as it does for `sent`).
    gate_sent: tuple[bool, float] | None = None


def _sameness(metadata: Mapping[str, Any]) -> Any:
    """A metadata patch with a hand-off of peers (not storage) as just "peers"."""
    annotations = dict(metadata.get("annotations") or {})
    handoff = PeerHandoff.parse(annotations.get(PEERS_ANNOTATION))
    if handoff is not None and handoff.peers and not handoff.storage:
        annotations[PEERS_ANNOTATION] = "peers"
    return json.dumps({**metadata, "annotations": annotations}, sort_keys=True)


@dataclass
class OperatorState:
    """Clients, settings and the records; handlers get it from kopf's memo."""

    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    http: WorkerClient
    settings: Settings = field(default_factory=Settings)
    metrics: Metrics = field(default_factory=lambda: METRICS)
    deployments: dict[str, DeploymentRecord] = field(default_factory=dict)
    pods: dict[str, PodRecord] = field(default_factory=dict)
    passes: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_PASSES))
    # Per GPU resource name (spec.template.gpuResource): when fetched, the most any node offers.
    node_gpus: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    # Namespaces whose PodSecurity level refused the node compile store's hostPath
    # (podsecurity.py): their pods are rendered without it for the rest of this operator's life.
    no_node_store: set[str] = field(default_factory=set)
    _node_fetches: dict[str, asyncio.Future[int | None]] = field(default_factory=dict)

    @classmethod
    def from_environment(cls) -> OperatorState:
        api = kube.load_config()
        return cls(
            core=client.CoreV1Api(api),
            custom=client.CustomObjectsApi(api),
            http=WorkerClient(),
            settings=Settings.from_environment(),
        )

    # -- records
    def deployment(self, uid: str) -> DeploymentRecord:
        return self.deployments.setdefault(uid, DeploymentRecord())

    def pod(self, uid: str) -> PodRecord:
        return self.pods.setdefault(uid, PodRecord())

    def forget(self, uid: str) -> None:
        self.deployments.pop(uid, None)
        self.metrics.forget(uid)

    def forget_pod(self, uid: str) -> None:
        """A deleted pod's probe and failure memory goes with it."""
        self.pods.pop(uid, None)

    # -- wake-ups
    def wake_event(self, uid: str) -> asyncio.Event:
        return self.deployment(uid).wake

    def wake(self, uid: str) -> None:
        record = self.deployments.get(uid)
        if record is not None:
            record.wake.set()

    def wake_on_generation(self, uid: str, generation: int | None) -> None:
        """Wake the loop when an event shows a generation its last pass did not plan for."""
        record = self.deployments.get(uid)
        if record is not None and record.generation not in (None, generation):
            record.wake.set()

    # -- what a pass needs
    def await_pod(self, uid: str, name: str) -> None:
        self.deployment(uid).awaited[name] = time.monotonic() + CREATED_POD_WAIT_SECONDS

    def awaited_pods(self, uid: str, indexed: set[str]) -> list[str]:
        """Pods created for `uid` that are still missing from the index (and not given up on)."""
        record = self.deployments.get(uid)
        if record is None:
            return []
        now = time.monotonic()
        for name in [n for n, until in record.awaited.items() if n in indexed or until < now]:
            del record.awaited[name]
        return list(record.awaited)

    def woke_spares(self, uid: str, names: set[str]) -> None:
        record = self.deployment(uid)
        for name in names:
            record.woken[name] = time.monotonic() + CREATED_POD_WAIT_SECONDS

    def still_spare_labelled(self, uid: str, labelled: set[str]) -> set[str]:
        """Spares woken for `uid` that the index still shows with their spare label (and not
        given up on): they are spares no more."""
        record = self.deployments.get(uid)
        if record is None or not record.woken:
            return set()
        now = time.monotonic()
        for name in [n for n, until in record.woken.items() if n not in labelled or until < now]:
            del record.woken[name]
        return set(record.woken)

    def should_patch(self, uid: str | None, metadata: Mapping[str, Any]) -> bool:
        """False when the same patch went to the pod lately and the index has not shown it. A
        hand-off of peers is the same as another of peers: a Target handed peers pulls from
        them; a longer list planned against the lagging index only rewrote its file."""
        record = self.pods.get(uid or "")
        if record is None or record.sent is None or time.monotonic() >= record.sent[1]:
            return True
        return _sameness(json.loads(record.sent[0])) != _sameness(metadata)

    def patched(self, uid: str | None, metadata: Mapping[str, Any]) -> None:
        if uid:
            until = time.monotonic() + CREATED_POD_WAIT_SECONDS
            self.pod(uid).sent = (json.dumps(metadata, sort_keys=True), until)

    def index_shows(self, uid: str, meta: Mapping[str, Any]) -> None:
        """The pod as kopf's index has it: once it shows the patch sent, forget the patch."""
        record = self.pods.get(uid)
        if record is None or record.sent is None:
            return
        sent = json.loads(record.sent[0])
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        if all(labels.get(k) == v for k, v in (sent.get("labels") or {}).items()) and all(
            annotations.get(k) == v for k, v in (sent.get("annotations") or {}).items()
        ):
            record.sent = None

    def status_of(self, uid: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ModelDeployment's status as last planned: ours if we planned one, else the
        body's."""
        record = self.deployments.get(uid)
        if record is not None and record.status is not None:
            written: dict[str, Any] = json.loads(record.status)
            return written
        return body.get("status")

    def wrote_status(self, uid: str, status: Mapping[str, Any]) -> None:
        record = self.deployment(uid)
        record.status, record.written_at = json.dumps(status).encode(), time.monotonic()
        record.written_key, record.pending = state_key(status), False

    def held_status(self, uid: str, status: Mapping[str, Any]) -> None:
        """Planned, not written yet (coalesced): the next passes plan from it."""
        record = self.deployment(uid)
        record.status, record.pending = json.dumps(status).encode(), True

    async def post_event(
        self, involved: Mapping[str, Any], kind: str, reason: str, message: str
    ) -> None:
        """The operator's one path to Events; best effort (the status carries the same truth)."""
        try:
            await asyncio.to_thread(kube.post_event, self.core, involved, kind, reason, message)
        except Exception:
            name = involved.get("metadata", {}).get("name")
            logging.getLogger(__name__).warning("could not post event %s on %s", reason, name)

    def settings_for(self, namespace: str) -> Settings:
        """The settings a pod in `namespace` is rendered with."""
        if namespace in self.no_node_store:
            return dataclasses.replace(self.settings, compile_store="")
        return self.settings

    async def max_node_gpus(self, resource: str = DEFAULT_GPU_RESOURCE) -> int | None:
        """The most `resource` a node offers. Cached; when it runs out, one LIST of nodes serves
        every pass waiting for it."""
        fetched, value = self.node_gpus.get(resource, (0.0, None))
        if time.monotonic() - fetched <= NODE_CACHE_SECONDS:
            return value
        fetch = self._node_fetches.get(resource)
        if fetch is None or fetch.done():
            fetch = self._node_fetches[resource] = asyncio.ensure_future(
                self._fetch_node_gpus(resource)
            )
        return await asyncio.shield(fetch)

    async def _fetch_node_gpus(self, resource: str) -> int | None:
        # The fetch caches its own answer. Cached by its waiters instead, a pass that came
        # between the LIST's end and their wake-up saw a stale cache, started a new LIST and
        # left the waiters' answer uncached: 36 LISTs back to back in `bench operator`.
        value = await asyncio.to_thread(kube.max_node_gpus, self.core, resource)
        self.node_gpus[resource] = (time.monotonic(), value)
        return value
