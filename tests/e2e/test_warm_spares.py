"""Warm spares on the process node, for real (builtin runtime): a deployment keeps a spare pod
waiting in Standby beyond its replicas; a scale-up through the scale subresource (what
`kubectl scale` and an HPA use) is served by that very pod (same UID), a new spare takes its
place, and the scale subresource counts and selects serving pods only."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client, watch

from tests.support.cluster import Kubectl
from tests.support.e2e import READY_TIMEOUT
from weightlift.api.labels import (
    IDENTITY_LABEL,
    PEERS_ANNOTATION,
    SPARE_LABEL,
    WOKEN_ANNOTATION,
)
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.cluster import tool_path
from weightlift.local.kube import call
from weightlift.local.observe import Observer, infer
from weightlift.local.scaleup import serving_ready, spare_rows, spare_then_cold
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


class PodVersions(threading.Thread):
    """Every version of one pod (its metadata) from a watch begun where the pod is now, until
    the API server says it is deleted."""

    def __init__(self, stack: LocalStack, name: str) -> None:
        super().__init__(name=f"pod-versions-{name}", daemon=True)
        self.stack, self.pod = stack, name
        pod = call(stack.kube.core.read_namespaced_pod, name, stack.namespace)
        self.versions: list[JSON] = [pod["metadata"]]
        self.version = pod["metadata"]["resourceVersion"]
        self.deleted = threading.Event()
        self.halt = threading.Event()
        self.broken: JSON | None = None  # the watch's ERROR (e.g. 410 Gone: versions missed)
        self.start()

    def run(self) -> None:
        plain = client.ApiClient()  # the watch's model objects back to wire JSON
        while not self.halt.is_set() and not self.deleted.is_set() and self.broken is None:
            stream = watch.Watch().stream(
                self.stack.kube.core.list_namespaced_pod,
                self.stack.namespace,
                field_selector=f"metadata.name={self.pod}",
                resource_version=self.version,
                timeout_seconds=5,
            )
            for event in stream:
                if event["type"] == "ERROR":
                    self.broken = dict(event)
                    break
                meta = plain.sanitize_for_serialization(event["object"])["metadata"]
                self.versions.append(meta)
                self.version = meta["resourceVersion"]
                if event["type"] == "DELETED":
                    self.deleted.set()
                    break

    def until_deleted(self, timeout: float) -> list[JSON]:
        """Its versions, once the last has been seen (AssertionError if not within timeout)."""
        deadline = time.monotonic() + timeout
        while not self.deleted.wait(0.2) and self.broken is None and time.monotonic() < deadline:
            pass
        gone = self.deleted.is_set()
        self.halt.set()
        assert self.broken is None, f"the watch of {self.pod} broke: {self.broken}"
        assert gone, f"{self.pod} not deleted within {timeout:.0f}s ({len(self.versions)} seen)"
        return list(self.versions)


def _spares(obs: Observer) -> list[JSON]:
    return [r for r in obs.replica_statuses() if r.get("spare")]


def _pod(obs: Observer, name: str) -> JSON:
    return next(p for p in obs.pods if p["metadata"]["name"] == name)


def _warm_spare(obs: Observer, other_than: Collection[str] = ()) -> JSON:
    """Wait for exactly one spare, in Standby, not one of `other_than`; its status row."""

    def warm(o: Observer) -> bool:
        rows = _spares(o)
        return (
            o.status().get("spares") == 1
            and len(rows) == 1
            and rows[0]["phase"] == "Spare"
            and rows[0]["name"] not in other_than
        )

    obs.wait(warm, READY_TIMEOUT, "one warm spare in Standby")
    return _spares(obs)[0]


def _scale(stack: LocalStack, name: str) -> JSON:
    scale: JSON = call(
        stack.kube.custom.get_namespaced_custom_object_scale,
        GROUP,
        VERSION,
        stack.namespace,
        PLURAL,
        name,
    )
    return scale


def _selected(stack: LocalStack, selector: str) -> set[str]:
    listing = call(stack.kube.core.list_namespaced_pod, stack.namespace, label_selector=selector)
    return {p["metadata"]["name"] for p in listing["items"]}


def _worker_phase(obs: Observer, name: str) -> str:
    ip = _pod(obs, name)["status"]["podIP"]
    with contextlib.suppress(httpx.HTTPError, ValueError):
        report = httpx.get(f"http://{ip}:8000/weightlift/v1/status", timeout=5).json()
        return str(report.get("phase"))
    return "unreachable"


def test_a_scale_up_is_served_by_the_spares_own_pod(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    obs = deployments("spares", model_dir, probe, replicas=1, warm_spares=1)
    obs.wait_ready(READY_TIMEOUT)
    spare = _warm_spare(obs)
    (source,) = [r for r in obs.replica_statuses() if r.get("ready")]
    status = obs.status()
    assert status["replicas"] == 1 and status["readyReplicas"] == 1 and status["ready"] == "1/1"
    assert not spare["ready"] and spare["role"] == "Target" and spare["hooksRun"] is True
    # The spare's pod: labelled, handed nothing, not Ready, its worker waiting in Standby.
    pod = _pod(obs, spare["name"])
    uid = pod["metadata"]["uid"]
    assert pod["metadata"]["labels"][SPARE_LABEL] == "true"
    assert pod["metadata"]["annotations"][PEERS_ANNOTATION] == ""
    ready = [c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "False"
    assert _worker_phase(obs, spare["name"]) == "Standby"
    # What an HPA sees: one replica, and a selector that leaves the spare out.
    scale = _scale(stack, "spares")
    assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
    assert _selected(stack, scale["status"]["selector"]) == {source["name"]}
    # What a user sees: `kubectl get md` shows the spare, `kubectl explain` what one costs.
    kubectl = Kubectl(tool_path("kubectl"), stack.kubeconfig)
    table = kubectl("get", "md", "spares", "-n", stack.namespace).stdout.split("\n")
    header, row = table[0].split(), table[1].split()
    assert dict(zip(header, row, strict=False))["SPARES"] == "1", table
    explained = " ".join(kubectl("explain", "modeldeployment.spec.warmSpares").stdout.split())
    assert "GPU pod" in explained and "Standby" in explained, explained

    kubectl("scale", "md", "spares", "--replicas=2", "-n", stack.namespace)
    obs.wait_ready(READY_TIMEOUT)
    rows = {r["name"]: r for r in obs.replica_statuses()}
    woken = rows[spare["name"]]
    assert woken["ready"] and not woken.get("spare"), woken
    assert woken["loadedFrom"] == f"peer:{source['name']}" and woken["role"] == "Target"
    pod = _pod(obs, spare["name"])
    assert pod["metadata"]["uid"] == uid, "the new replica is the spare's own pod"
    assert SPARE_LABEL not in pod["metadata"]["labels"]
    assert WOKEN_ANNOTATION in pod["metadata"]["annotations"]
    # A new spare takes its place; the scale subresource counts serving pods only.
    fresh = _warm_spare(obs, other_than={spare["name"]})
    assert fresh["name"] not in (source["name"], spare["name"])
    status = obs.status()
    assert status["replicas"] == 2 and status["readyReplicas"] == 2
    scale = _scale(stack, "spares")
    assert scale["status"]["replicas"] == 2
    assert _selected(stack, scale["status"]["selector"]) == {source["name"], spare["name"]}
    assert "SpareWoken" in {e["reason"] for e in stack.events("spares")}
    # It serves what its source serves.
    ip = pod["status"]["podIP"]
    source_ip = _pod(obs, source["name"])["status"]["podIP"]
    out = infer(f"http://{ip}:8000", "spares", probe["request"])["outputs"]
    assert out == infer(f"http://{source_ip}:8000", "spares", probe["request"])["outputs"]


def test_a_scale_up_from_zero_is_served_by_a_spare_from_storage(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    obs = deployments("zero", model_dir, probe, replicas=0, warm_spares=1)
    spare = _warm_spare(obs)
    assert obs.phase() == "Ready" and obs.status()["replicas"] == 0
    uid = _pod(obs, spare["name"])["metadata"]["uid"]
    stack.scale_md("zero", 1)
    obs.wait_ready(READY_TIMEOUT)
    (serving,) = [r for r in obs.replica_statuses() if r.get("ready")]
    assert serving["name"] == spare["name"] and serving["role"] == "Source"
    assert serving["loadedFrom"] == "storage:hostpath"
    assert _pod(obs, spare["name"])["metadata"]["uid"] == uid
    _warm_spare(obs, other_than={spare["name"]})


def test_a_revision_change_replaces_the_waiting_spares(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """None of the old identity's spares is handed anything: they go, and new ones wait."""
    model_dir, probe = demo_model
    obs = deployments("respin", model_dir, probe, replicas=1, warm_spares=1)
    obs.wait_ready(READY_TIMEOUT)
    old = _warm_spare(obs)
    old_identity = old["modelIdentity"]
    # Every version of the old spare's pod from here to its deletion, from a watch (a hand-off
    # and the deletion may come between two reads).
    versions = PodVersions(stack, old["name"])
    stack.patch_md("respin", {"spec": {"model": {"revision": "2"}}})

    def rolled(o: Observer) -> bool:
        identity = o.status().get("modelIdentity")
        identities = {p["metadata"]["labels"][IDENTITY_LABEL] for p in o.pods}
        return identity != old_identity and o.phase() == "Ready" and identities == {identity}

    obs.wait(rolled, READY_TIMEOUT, "only pods of the new identity")
    seen = versions.until_deleted(READY_TIMEOUT)
    handed = [
        str(meta.get("annotations", {}).get(PEERS_ANNOTATION))
        for meta in seen
        if meta.get("annotations", {}).get(PEERS_ANNOTATION)
        or SPARE_LABEL not in meta.get("labels", {})
    ]
    assert handed == [], f"an old spare was handed something: {handed}"
    fresh = _warm_spare(obs, other_than={old["name"]})
    assert fresh["modelIdentity"] != old_identity
    assert old["name"] not in {p["metadata"]["name"] for p in obs.pods}
    (serving,) = [r for r in obs.replica_statuses() if r.get("ready")]
    assert serving["modelIdentity"] == fresh["modelIdentity"]


def test_demo_scale_ups_time_a_spare_and_a_cold_pod(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """What `weightlift demo --scale-up` measures: 1->2 served by the spare (its own pod), then,
    spares set to 0, 2->3 by a pod the scale-up creates; both pull from the Ready source."""
    model_dir, probe = demo_model
    obs = deployments("timed", model_dir, probe, replicas=1, warm_spares=1)
    obs.wait_ready(READY_TIMEOUT)
    (source,) = serving_ready(obs).values()
    spare, cold = spare_then_cold(obs, 1, READY_TIMEOUT)
    assert (spare.kind, spare.from_replicas, spare.to_replicas) == ("spare", 1, 2)
    assert spare.was_spare and spare.uid, spare
    assert (cold.kind, cold.from_replicas, cold.to_replicas) == ("cold", 2, 3)
    assert not cold.was_spare and cold.replica not in (spare.replica, source["name"]), cold
    for up in (spare, cold):
        assert up.role == "Target" and up.loaded_from.startswith("peer:"), up
        assert up.ready_s > 0
    assert obs.status()["spares"] == 0 and not spare_rows(obs)
    assert set(serving_ready(obs)) == {source["name"], spare.replica, cold.replica}
