"""Handler wiring against kmock's KubernetesEmulator: kopf + the sync kubernetes client, in-process.

The emulator is an in-memory HTTP store, not an API server: no scheduler, no kubelet, no schema,
no defaults, no garbage collector. A small subclass adds what the wiring relies on and any real
API server provides (uid, creationTimestamp, generateName, equality label selectors), so these
tests check that the operator reads and writes the right objects, not how pods come to life.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.config import kube_config

from tests.support.planning import no_sources
from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    IDENTITY_LABEL,
    PEERS_ANNOTATION,
    REPLICA_LABEL,
    ROLE_LABEL,
    published_sources_selector,
)
from weightlift.api.model import GROUP, KIND, PLURAL, VERSION, ProbeResult
from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    PLAN_CONFIGMAP_ENV,
    PLAN_KEY,
    PLAN_SHA256_ENV,
    Assignment,
    SharedPlan,
    WorkerPlan,
    plan_digest,
)
from weightlift.operator import handlers, kube, statuswrites
from weightlift.operator import state as operator_state
from weightlift.operator.identity import model_identity
from weightlift.operator.planning import SpecError
from weightlift.operator.reconcile import parse_spec
from weightlift.operator.reconcile import reconcile as real_reconcile
from weightlift.operator.state import OperatorState

NS = "wl-test"
MD_RESOURCE = kmock.resource(GROUP, VERSION, PLURAL)
PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
MD_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"


class Emulator(kmock.KubernetesEmulator):
    """KubernetesEmulator plus the server-side bits every real API server fills in."""

    _counter = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            meta.setdefault("namespace", request.namespace)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = str(next(self._counter))
        if (
            request.action == kmock.action.UPDATE
            and "apply-patch" in request.headers.get("Content-Type", "")
            and request.resource is not None
            and isinstance(request.data, dict)
        ):  # server-side apply creates what does not exist yet (the operator's Service)
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                self.objects[key] = request.data
        return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        listing = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            listing["items"] = [
                item
                for item in listing["items"]
                if all(
                    (item.get("metadata", {}).get("labels") or {}).get(k) == v
                    for k, v in wanted.items()
                )
            ]
        fields = request.params.get("fieldSelector")
        if fields:  # a CRD's selectableFields: =, != on a path; an absent field is ""
            terms = [_field_term(term) for term in fields.split(",")]
            listing["items"] = [
                item
                for item in listing["items"]
                if all((_field_value(item, path) == value) == equal for path, equal, value in terms)
            ]
        return listing


def _field_term(term: str) -> tuple[str, bool, str]:
    if "!=" in term:
        path, value = term.split("!=", 1)
        return path, False, value
    path, value = term.split("=", 1)
    return path, True, value


def _field_value(item: dict[str, Any], path: str) -> str:
    value: Any = item
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _verb(request: kmock.Request) -> str:
    if request.action in (kmock.action.LIST, kmock.action.WATCH):
        return request.action.name
    return request.method.name


@dataclass
class Cluster:
    emulator: Emulator
    url: str

    def md(self, name: str) -> dict[str, Any] | None:
        key = (MD_RESOURCE, NS, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return dict(self.emulator.objects[key].raw)

    def pods(self, **labels: str) -> list[dict[str, Any]]:
        return [
            dict(obj.raw)
            for (resource, namespace, _), obj in list(self.emulator.objects.items())
            if resource == PODS and namespace == NS and not obj.deleted
            if all(obj.raw["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def events(self, involved: str) -> list[dict[str, Any]]:
        return [
            dict(obj.raw)
            for (resource, _, _), obj in list(self.emulator.objects.items())
            if resource == EVENTS and not obj.deleted
            if obj.raw.get("involvedObject", {}).get("name") == involved
        ]

    def plan_of(self, pod: dict[str, Any]) -> WorkerPlan:
        """The plan this pod's worker reads: its plan ConfigMap (digest checked) + assignment."""
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        key = (CONFIGMAPS, NS, env[PLAN_CONFIGMAP_ENV])
        text = self.emulator.objects[key].raw["data"][PLAN_KEY]
        assert plan_digest(text) == env[PLAN_SHA256_ENV]
        return WorkerPlan.compose(
            SharedPlan.model_validate_json(text),
            Assignment.model_validate_json(env[ASSIGNMENT_ENV]),
        )

    def operator_requests(self, since: int = 0) -> list[str]:
        """ "VERB path" (GET, LIST, POST, PATCH ...) of the requests the operator's kubernetes
        client made, from request `since` on. kopf's own watches and patches use aiohttp and
        are not counted: they are the watch that keeps the live body and the indexes current."""
        return [
            f"{_verb(request)} {request.url.path}"
            + (f"?{request.url.query_string}" if _verb(request) == "LIST" else "")
            for request in list(self.emulator)[since:]
            if "OpenAPI-Generator" in request.headers.get("User-Agent", "")
        ]

    def kopf_watches(self) -> set[str]:
        """Resources kopf has opened a watch on."""
        return {
            request.url.path.rsplit("/", 1)[-1]
            for request in list(self.emulator)
            if request.action == kmock.action.WATCH
            and "kopf" in request.headers.get("User-Agent", "")
        }

    def request_count(self) -> int:
        return len(list(self.emulator))

    async def create_md(self, name: str, spec: Any) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
        response = await self.emulator.post(MD_PATH, json=body)
        assert response.status == 200, await response.text()
        created: dict[str, Any] = await response.json()
        return created

    async def patch_md(self, name: str, patch: dict[str, Any]) -> None:
        if "spec" in patch:  # as the API server does (kmock does not): a spec change, a generation
            current = self.md(name) or {}
            generation = int(current.get("metadata", {}).get("generation") or 1) + 1
            patch = {**patch, "metadata": {**patch.get("metadata", {}), "generation": generation}}
        response = await self.emulator.patch(f"{MD_PATH}/{name}", json=patch)
        assert response.status == 200, await response.text()

    async def patch_pod(self, name: str, patch: dict[str, Any]) -> None:
        response = await self.emulator.patch(f"/api/v1/namespaces/{NS}/pods/{name}", json=patch)
        assert response.status == 200, await response.text()

    async def delete_md(self, name: str) -> None:
        response = await self.emulator.delete(f"{MD_PATH}/{name}")
        assert response.status == 200, await response.text()


async def eventually(
    check: Callable[[], Any], timeout: float = 30.0, what: str = "condition"
) -> Any:
    """Poll until check() returns something truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last value: {value!r}")


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    emulator = Emulator()
    emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND,
        singular="modeldeployment",
        namespaced=True,
        verbs={"list", "watch", "get", "patch", "create", "delete"},
        subresources={"status"},
    )
    emulator.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", singular="pod", namespaced=True, verbs={"list", "watch", "create", "delete"}
    )
    emulator.resources["v1/services"] = kmock.ResourceInfo(
        kind="Service", singular="service", namespaced=True, verbs={"patch", "delete"}
    )
    emulator.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs={"create"}
    )
    emulator.resources["v1/nodes"] = kmock.ResourceInfo(
        kind="Node", singular="node", namespaced=False, verbs={"list"}
    )
    # kopf waits to discover these two even with scanning disabled (it never lists them then).
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"list", "watch"}
    )
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"}
    )
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            "current-context": "kmock",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(path))
        # kopf logs in through the kubernetes client, which read $KUBECONFIG once at import.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        # Never fall into a real cluster's in-cluster config when the tests run inside a pod.
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        # Made-up pod IPs below are never contacted.
        monkeypatch.setenv("WEIGHTLIFT_PROBE_NETWORKS", "127.0.0.0/8")
        monkeypatch.setenv("WEIGHTLIFT_MODEL_PATH_PREFIXES", "/models")
        previous = client.Configuration.get_default_copy()
        try:
            yield Cluster(emulator=emulator, url=url)
        finally:
            client.Configuration.set_default(previous)


@dataclass
class Operator:
    runner: KopfRunner

    def alive(self) -> bool:
        return self.runner._thread.is_alive()


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[Operator]:
    async with _operator(cluster) as running:
        yield running


@contextlib.asynccontextmanager
async def _operator(cluster: Cluster) -> AsyncIterator[Operator]:
    """kopf in its own thread and event loop, as `weightlift operator` runs it.

    Not kopf.operator() in the test's loop: on exit kopf cancels every task of its loop that
    it did not see at startup, which would include the emulator's server and this fixture.
    """
    # No namespace/CRD scanning: the namespace is named exactly, and kmock 0.8 cannot serve
    # GET /api/v1/namespaces (its path parser reads "namespaces" as a namespaced path: HTTP 500).
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    runner = KopfRunner(
        ["run", "--standalone", "--namespace", NS, "-m", "weightlift.operator.handlers"],
        settings=settings,
        timeout=30,
    )
    # Enter and exit off the loop: the operator's API calls are served by this loop.
    await asyncio.to_thread(runner.__enter__)
    try:
        # Ready once kopf watches both resources (its indexes fill from these watches, and
        # daemons start only after that): tests' deadlines then never include kopf's start-up,
        # which takes seconds on a loaded machine.
        await eventually(lambda: cluster.kopf_watches() >= {"pods", PLURAL}, 120, "kopf's watches")
        yield Operator(runner)
    finally:
        started = time.monotonic()
        await asyncio.to_thread(runner.__exit__, None, None, None)
        stop_seconds = time.monotonic() - started
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert stop_seconds < 10, f"the operator took {stop_seconds:.1f} s to stop"


SPEC = {
    "model": {"uri": "hostpath:///models/llama", "revision": "v1"},
    "replicas": 3,
    "parallelism": {"tensor": 2},
    "loading": {"initialSources": 1, "waitForSourceSeconds": 600},
    "template": {"nodeSelector": {"gpu": "h100"}},
}


@dataclass
class Passes:
    """Completed reconcile passes per ModelDeployment: tests wait for a pass instead of sleeping."""

    done: dict[str, int] = field(default_factory=dict)
    requeue: float | None = None  # overrides the plan's timer when set

    def __call__(self, name: str) -> int:
        return self.done.get(name, 0)

    async def after(self, name: str, count: int) -> None:
        """Until more than `count` passes of `name` have completed."""
        await eventually(lambda: self(name) > count, what=f"pass {count + 1} of {name}")


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Passes:
    recorder = Passes()

    async def counted(state: Any, body: Any, *args: Any, **kwargs: Any) -> float:
        name = body["metadata"]["name"]
        try:
            delay = await real_reconcile(state, body, *args, **kwargs)
        finally:
            recorder.done[name] = recorder.done.get(name, 0) + 1
        return delay if recorder.requeue is None else recorder.requeue

    monkeypatch.setattr(handlers, "reconcile", counted)
    return recorder


@pytest.fixture
def slow_timer(passes: Passes, monkeypatch: pytest.MonkeyPatch) -> Passes:
    """Reconcile passes ask for no timer wake-up within a test's patience: anything that happens
    promptly was woken by a pod or spec event. So no status write is held back either (a held
    write comes back by the timer: statuswrites.py, tested on its own)."""
    passes.requeue = 120.0
    monkeypatch.setattr(statuswrites, "STATUS_COALESCE_SECONDS", 0.0)
    return passes


def ours(events: list[dict[str, Any]]) -> list[str]:
    """Reasons of the events, asserting every one came from the operator's own event path."""
    sources = {e.get("source", {}).get("component") for e in events}
    assert sources <= {"weightlift-operator"}, f"events from elsewhere: {events}"
    return [e["reason"] for e in events]


async def test_first_source_pod_status_without_progress_events(
    cluster: Cluster, slow_timer: Passes, operator: Operator
) -> None:
    created = await cluster.create_md("llama", SPEC)
    uid = created["metadata"]["uid"]

    await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "llama"}), what="a pod")
    # Every replica at once: the source and two targets in standby (no peers until a source is
    # Ready). The pods' own events wake more passes: they must not add more.
    await slow_timer.after("llama", 1)
    pods = cluster.pods(**{DEPLOYMENT_LABEL: "llama"})
    assert len(pods) == 3, [p["metadata"]["name"] for p in pods]
    pods.sort(key=lambda p: int(p["metadata"]["labels"][REPLICA_LABEL]))
    pod = pods[0]
    for target in pods[1:]:
        assert target["metadata"]["labels"][ROLE_LABEL] == "Target"
        assert cluster.plan_of(target).peers == []
        assert not target["metadata"]["annotations"].get(PEERS_ANNOTATION)
    labels = pod["metadata"]["labels"]
    assert labels[ROLE_LABEL] == "Source"
    assert labels[REPLICA_LABEL] == "0"
    assert labels["app.kubernetes.io/managed-by"] == "weightlift"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        KIND,
        "llama",
        uid,
        True,
    )
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    worker = pod["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2"
    plan = cluster.plan_of(pod)
    assert (plan.role, plan.deployment, plan.namespace, plan.ranks) == (
        "Source",
        "llama",
        NS,
        [0, 1],
    )

    def status() -> dict[str, Any] | None:
        md = cluster.md("llama")
        return (md or {}).get("status") or None

    found = await eventually(status, what="a status")
    assert found["replicas"] == 3
    assert found["ready"] == "0/3"
    assert found["readyReplicas"] == 0
    assert found["phase"] in ("Pending", "WaitingForSource", "Loading")
    assert found["observedGeneration"] == 1
    assert found["modelIdentity"] == labels["weightlift.dev/identity"]
    assert f"{DEPLOYMENT_LABEL}=llama" in found["selector"]
    conditions = {c["type"]: c for c in found["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert {"Scheduled", "WeightsLoaded", "InferenceReady", "Ready"} <= set(conditions)

    assert found["phase"] == "Pending"
    assert found["replicaStatuses"][0]["name"] == pod["metadata"]["name"]
    assert found["replicaStatuses"][0]["role"] == "Source"

    # Play kubelet: the pod is bound and running (the worker is not reachable: its IP is outside
    # WEIGHTLIFT_PROBE_NETWORKS). The pod event wakes the loop; the phase moves on, with an Event.
    await cluster.patch_pod(
        pod["metadata"]["name"],
        {
            "spec": {"nodeName": "gpu-node-1"},
            "status": {
                "phase": "Running",
                "podIP": "10.77.0.5",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
            },
        },
    )

    def moved_on() -> dict[str, Any] | None:
        current = status() or {}
        return current if current.get("phase") not in (None, "Pending") else None

    moved = await eventually(moved_on, what="the phase to leave Pending")
    replica = moved["replicaStatuses"][0]
    assert (replica["node"], replica["podIP"]) == ("gpu-node-1", "10.77.0.5")
    scheduled = next(c for c in moved["conditions"] if c["type"] == "Scheduled")
    assert scheduled["message"].startswith("1/")

    # Progress (Pending, then Loading or Probing) posts no Event: the phase and its conditions'
    # transition times say it, and an Event per step cost two writes per deployment (issue 34).
    # Passes over the moved state post nothing either.
    seen = slow_timer("llama")
    await cluster.patch_pod(pod["metadata"]["name"], {"metadata": {"annotations": {"x": "1"}}})
    await slow_timer.after("llama", seen)
    assert moved["phase"] == "Loading"
    assert ours(cluster.events("llama")) == []

    # kopf's finalizer guards the pods' cleanup.
    md = cluster.md("llama")
    assert md is not None and f"{GROUP}/finalizer" in md["metadata"].get("finalizers", [])
    # ...and keeps no diff base: no annotation of its own, no patch to write one.
    assert not [k for k in md["metadata"].get("annotations") or {} if k.startswith(GROUP)]

    # A spec change wakes the loop too: scaling to 1 shows in the status at once.
    await cluster.patch_md("llama", {"spec": {"replicas": 1}})
    await eventually(lambda: (status() or {}).get("ready") == "0/1", what="ready 0/1")


async def test_a_failing_pass_posts_one_event_per_new_error(
    cluster: Cluster, slow_timer: Passes, operator: Operator, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = True
    real_patch_status = kube.patch_status

    def patch_status(*args: Any, **kwargs: Any) -> None:
        if refusing:
            raise RuntimeError("status write refused")
        real_patch_status(*args, **kwargs)

    monkeypatch.setattr(kube, "patch_status", patch_status)
    await cluster.create_md("llama", SPEC)
    pods = await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "llama"}), what="a pod")
    for i in range(3):  # three more failing passes over the same error
        seen = slow_timer("llama")
        await cluster.patch_pod(
            pods[0]["metadata"]["name"], {"metadata": {"labels": {"n": str(i)}}}
        )
        await slow_timer.after("llama", seen)
    assert ours(cluster.events("llama")) == ["ReconcileError"]
    assert "status write refused" in cluster.events("llama")[0]["message"]

    refusing = False  # the next pass gets through: the status follows, and no second Event
    await cluster.patch_pod(pods[0]["metadata"]["name"], {"metadata": {"labels": {"n": "ok"}}})
    await eventually(lambda: (cluster.md("llama") or {}).get("status"), what="a status")
    seen = slow_timer("llama")
    await cluster.patch_pod(pods[0]["metadata"]["name"], {"metadata": {"labels": {"n": "ok2"}}})
    await slow_timer.after("llama", seen)
    assert ours(cluster.events("llama")) == ["ReconcileError"]


async def test_deleting_the_model_deployment_deletes_its_pods(
    cluster: Cluster, slow_timer: Passes, operator: Operator
) -> None:
    await cluster.create_md("llama", SPEC)
    await cluster.create_md("other", {**SPEC, "replicas": 1})
    await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "llama"}), what="llama's pod")
    await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "other"}), what="other's pod")

    started = time.monotonic()
    await cluster.delete_md("llama")
    await eventually(lambda: cluster.md("llama") is None, what="the finalizer to release")
    # Far below the loop's 120 s sleep: the daemon's stop did not wait it out.
    assert time.monotonic() - started < 60, "deletion waited out the daemon's sleep"
    assert cluster.pods(**{DEPLOYMENT_LABEL: "llama"}) == []
    # The other ModelDeployment's pods are untouched.
    assert len(cluster.pods(**{DEPLOYMENT_LABEL: "other"})) == 1
    assert operator.alive()


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({**SPEC, "replicas": "abc"}, "spec.replicas"),
        ({**SPEC, "parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
        ({"replicas": 1}, "spec.model"),
    ],
    ids=["replicas-abc", "tensor-0", "no-model"],
)
async def test_a_malformed_spec_fails_only_its_own_object(
    cluster: Cluster, slow_timer: Passes, operator: Operator, bad: dict[str, Any], field: str
) -> None:
    await cluster.create_md("bad", bad)

    def failed() -> dict[str, Any] | None:
        status = (cluster.md("bad") or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    status = await eventually(failed, what="phase Failed")
    assert status["message"].startswith(field), status["message"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert field in ready["message"]
    warning = await eventually(
        lambda: [e for e in cluster.events("bad") if e["reason"] == "InvalidSpec"],
        what="an InvalidSpec event",
    )
    assert warning[0]["type"] == "Warning"
    assert field in warning[0]["message"]
    assert cluster.pods(**{DEPLOYMENT_LABEL: "bad"}) == []

    # Another pass over the same problem (woken by an unrelated spec edit) posts no second Event.
    seen = slow_timer("bad")
    await cluster.patch_md("bad", {"spec": {"template": {"image": "worker:2"}}})
    await slow_timer.after("bad", seen)
    assert ours(cluster.events("bad")) == ["InvalidSpec"]

    # The operator is still alive and reconciles the next, valid object.
    await cluster.create_md("good", {**SPEC, "replicas": 1})
    pods = await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "good"}), what="good's pod")
    assert pods[0]["metadata"]["labels"][ROLE_LABEL] == "Source"
    assert operator.alive()

    # Deleting the broken one is not held up by its loop's sleep (120 s here).
    started = time.monotonic()
    await cluster.delete_md("bad")
    await eventually(lambda: cluster.md("bad") is None, what="bad to be deleted")
    assert time.monotonic() - started < 60


async def test_steady_state_passes_make_no_api_reads(
    cluster: Cluster, slow_timer: Passes, operator: Operator
) -> None:
    """A pass reads its ModelDeployment from kopf's live body and its pods from kopf's pod index:
    once nothing changes, passes make no request at all (no GET of the ModelDeployment, no LIST
    of pods, no status patch, no Event)."""
    await cluster.create_md("llama", SPEC)
    pods = await eventually(lambda: cluster.pods(**{DEPLOYMENT_LABEL: "llama"}), what="a pod")
    name = pods[0]["metadata"]["name"]
    await cluster.patch_pod(
        name,
        {
            "spec": {"nodeName": "gpu-node-1"},
            "status": {"phase": "Running", "podIP": "10.77.0.5"},
        },
    )
    await eventually(
        lambda: ((cluster.md("llama") or {}).get("status") or {}).get("phase") == "Loading",
        what="the Loading transition",
    )
    first_passes = cluster.operator_requests()
    mark = cluster.request_count()
    for i in range(5):  # each pod event wakes one more pass over the same state
        seen = slow_timer("llama")
        await cluster.patch_pod(name, {"metadata": {"annotations": {"nudge": str(i)}}})
        await slow_timer.after("llama", seen)
    steady = cluster.operator_requests(since=mark)
    assert steady == [], f"steady-state passes made requests: {steady}"
    # The passes that changed something wrote; they read twice: the nodes once (for the GPU
    # check) and, before the storage load, the sources published for this identity (from the
    # API server's watch cache: resourceVersion 0).
    reads = [r for r in first_passes if r.split()[0] in ("GET", "LIST", "WATCH")]
    identity = cluster.md("llama")["status"]["modelIdentity"]  # type: ignore[index]
    selector = urllib.parse.quote(published_sources_selector(identity), safe=",!")
    published = f"LIST {MD_PATH}?fieldSelector={selector}&resourceVersion=0"
    assert sorted(reads) == ["LIST /api/v1/nodes?", published]


async def test_reconcile_passes_take_turns(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most MAX_PASSES passes run at once; the others wait their turn, and every
    deployment still gets its passes."""
    monkeypatch.setattr(operator_state, "MAX_PASSES", 2)
    running: list[str] = []
    most = 0
    done: dict[str, int] = {}

    async def slow(state: Any, body: Any, *args: Any, **kwargs: Any) -> float:
        nonlocal most
        name = body["metadata"]["name"]
        running.append(name)
        most = max(most, len(running))
        try:
            await asyncio.sleep(0.2)  # a pass waiting on API threads and probes
            return await real_reconcile(state, body, *args, **kwargs)
        finally:
            running.remove(name)
            done[name] = done.get(name, 0) + 1

    monkeypatch.setattr(handlers, "reconcile", slow)
    names = [f"md-{i}" for i in range(5)]
    async with _operator(cluster):
        for name in names:
            await cluster.create_md(name, SPEC)
        await eventually(lambda: all(done.get(n, 0) >= 2 for n in names), what="2 passes each")
    assert most == 2


# ------------------------------------------------------ the kube wrappers against the emulator


@pytest.fixture
def core(cluster: Cluster) -> client.CoreV1Api:
    return client.CoreV1Api(kube.load_config())


async def test_kube_wrappers_round_trip_pods_and_labels(
    cluster: Cluster, core: client.CoreV1Api
) -> None:
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p0", "namespace": NS, "labels": {DEPLOYMENT_LABEL: "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    assert await asyncio.to_thread(kube.create_pod, core, NS, manifest) is True
    assert await asyncio.to_thread(kube.create_pod, core, NS, manifest) is False  # 409
    listed = await asyncio.to_thread(kube.list_pods, core, NS, f"{DEPLOYMENT_LABEL}=x")
    assert [p["metadata"]["name"] for p in listed] == ["p0"]

    await asyncio.to_thread(
        kube.patch_pod_metadata, core, NS, "p0", {"labels": {ROLE_LABEL: "Source"}}
    )
    patch = [r for r in cluster.emulator if r.method == kmock.method.PATCH][-1]
    headers = {k.lower(): v for k, v in patch.headers.items()}
    assert headers["content-type"] in (
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    )
    assert cluster.pods()[0]["metadata"]["labels"] == {DEPLOYMENT_LABEL: "x", ROLE_LABEL: "Source"}

    await asyncio.to_thread(kube.delete_pod, core, NS, "p0")
    await asyncio.to_thread(kube.delete_pod, core, NS, "p0")  # 404 is fine
    assert cluster.pods() == []


async def _publish_feeder_source(cluster: Cluster, passes: Passes | None) -> dict[str, Any]:
    """A sibling ModelDeployment "feeder" that publishes one Ready source, written the way the
    operator publishes one (status.sources and readySources in one write). With an operator
    running, its own first pass over the feeder comes first (it would overwrite the status)."""
    await cluster.create_md("feeder", {**SPEC, "replicas": 0})
    if passes is not None:
        await passes.after("feeder", 0)
    identity = _identity_of(SPEC)
    source = {
        "pod": "feeder-pod-0",
        "deployment": "feeder",
        "address": "127.0.9.9:8000",
        "modelIdentity": identity,
        "ranks": [0, 1],
    }
    status = {"modelIdentity": identity, "readySources": 1, "sources": [source]}
    await cluster.patch_md("feeder", {"status": status})
    return source


def _assert_fed_by_feeder(pods: list[dict[str, Any]]) -> None:
    for pod in pods:
        assert pod["metadata"]["labels"][ROLE_LABEL] == "Target"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        plan = Assignment.model_validate_json(env[ASSIGNMENT_ENV])
        assert [(p.pod, p.address) for p in plan.peers] == [("feeder-pod-0", "127.0.9.9:8000")]


async def test_a_sibling_deployments_source_feeds_new_replicas(
    cluster: Cluster, slow_timer: Passes, operator: Operator
) -> None:
    """A ModelDeployment created right after a sibling published a Ready source of its identity
    pulls from it: no replica loads from storage, whether kopf's index has seen the source yet
    (the index feeds the planner) or not (the reconcile reads the published sources first)."""
    await _publish_feeder_source(cluster, slow_timer)

    await cluster.create_md("eater", {**SPEC, "replicas": 2})
    pods = await eventually(
        lambda: (
            len(cluster.pods(**{DEPLOYMENT_LABEL: "eater"})) == 2
            and cluster.pods(**{DEPLOYMENT_LABEL: "eater"})
        ),
        what="both of eater's pods at once (no waiting for a source of its own)",
    )
    _assert_fed_by_feeder(pods)


async def test_a_storage_load_waits_for_a_source_the_index_has_not_seen(
    cluster: Cluster,
) -> None:
    """The index lags (here: it has nothing at all). Before it starts a storage load, a pass
    reads the sources published for its identity, and pulls from them instead."""
    await _publish_feeder_source(cluster, None)
    eater = await cluster.create_md("eater", {**SPEC, "replicas": 2})
    state = await asyncio.to_thread(OperatorState.from_environment)
    try:
        await real_reconcile(state, eater, [], no_sources, logging.getLogger("test"))
    finally:
        await state.http.aclose()
    _assert_fed_by_feeder(cluster.pods(**{DEPLOYMENT_LABEL: "eater"}))
    assert len(cluster.pods(**{DEPLOYMENT_LABEL: "eater"})) == 2
    lists = [r for r in cluster.operator_requests() if r.startswith(f"LIST {MD_PATH}")]
    assert len(lists) == 1, lists


async def test_the_published_sources_selector_follows_the_status(
    cluster: Cluster,
) -> None:
    """The field selector finds a deployment with its first published source and stops finding
    it when none is left; publishing writes nothing but the status (no label patch)."""
    md = await cluster.create_md("solo", {**SPEC, "replicas": 1})
    state = await asyncio.to_thread(OperatorState.from_environment)
    log = logging.getLogger("test")
    pod = {
        "metadata": {
            "name": "solo-pod-0",
            "uid": "pod-uid-0",
            "labels": {REPLICA_LABEL: "0", ROLE_LABEL: "Source"},
        },
        "spec": {"nodeName": "gpu-node-1"},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }
    selector = published_sources_selector(_identity_of(md["spec"]))

    def selected() -> list[str]:
        found = kube.list_deployments(state.custom, NS, selector)
        return [m["metadata"]["name"] for m in found]

    try:
        # A replica that passed its probe (probe results are kept per pod uid between passes).
        ready_pod = {
            **pod,
            "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "True"}]},
        }
        pod["metadata"]["labels"][IDENTITY_LABEL] = _identity_of(md["spec"])
        passed = ProbeResult(passed=True, message="ok", last_probe_time="2026-01-01T00:00:00Z")
        state.pod("pod-uid-0").probe = (time.monotonic(), passed)
        await real_reconcile(state, cluster.md("solo") or md, [ready_pod], no_sources, log)
        published = cluster.md("solo") or {}
        assert [s["pod"] for s in published["status"]["sources"]] == ["solo-pod-0"]
        assert published["status"]["readySources"] == 1
        assert await asyncio.to_thread(selected) == ["solo"]
        # The replica is gone: the sources are withdrawn, and the selector finds it no more.
        await real_reconcile(state, published, [], no_sources, log)
        after = cluster.md("solo") or {}
        assert not (after.get("status") or {}).get("sources")
        assert await asyncio.to_thread(selected) == []
        writes = [r for r in cluster.operator_requests() if r.startswith(f"PATCH {MD_PATH}")]
        assert writes and all(r.split("?")[0].endswith("/solo/status") for r in writes), writes
    finally:
        await state.http.aclose()


def _identity_of(raw_spec: dict[str, Any]) -> str:
    spec = parse_spec(raw_spec)
    assert not isinstance(spec, SpecError)
    return model_identity(spec)
