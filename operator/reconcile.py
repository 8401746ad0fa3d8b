"""One reconcile pass: observe (API objects, worker reports, probes) -> plan -> apply."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from weightlift.api.labels import DEPLOYMENT_LABEL, IDENTITY_LABEL, REPLICA_LABEL, ROLE_LABEL
from weightlift.api.model import (
    Condition,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    ProbeResult,
    SourceEndpoint,
)
from weightlift.api.times import parse_rfc3339, rfc3339
from weightlift.api.worker import WorkerReport
from weightlift.operator import kube
from weightlift.operator.planning import Event, Observed, ObservedPod, Plan, host_port, plan
from weightlift.operator.pods import GPU_RESOURCE, render_pod, role_of
from weightlift.operator.probes import fetch_report, may_contact, probe_inference

NODE_CACHE_SECONDS = 60.0


@dataclass
class OperatorState:
    """What the operator keeps between reconciles: clients, wake-ups, probe memory."""

    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    http: httpx.AsyncClient
    wakes: dict[str, asyncio.Event] = field(default_factory=dict)
    probes: dict[str, tuple[float, ProbeResult]] = field(default_factory=dict)  # pod uid ->
    failures_seen: dict[str, datetime] = field(default_factory=dict)  # pod uid -> first seen
    node_gpus: tuple[float, int | None] = (0.0, None)

    @classmethod
    def from_environment(cls) -> OperatorState:
        api = kube.load_config()
        return cls(
            core=client.CoreV1Api(api),
            custom=client.CustomObjectsApi(api),
            http=httpx.AsyncClient(trust_env=False),
        )

    def wake_event(self, uid: str) -> asyncio.Event:
        return self.wakes.setdefault(uid, asyncio.Event())

    def wake(self, uid: str) -> None:
        if uid in self.wakes:
            self.wakes[uid].set()

    def forget(self, uid: str) -> None:
        self.wakes.pop(uid, None)

    def forget_pod(self, uid: str) -> None:
        """A deleted pod's probe and failure memory goes with it."""
        self.probes.pop(uid, None)
        self.failures_seen.pop(uid, None)

    async def post_event_safe(
        self, namespace: str, name: str, kind: str, reason: str, message: str
    ) -> None:
        involved = {"metadata": {"name": name, "namespace": namespace}}
        try:
            await asyncio.to_thread(kube.post_event, self.core, involved, kind, reason, message)
        except Exception:  # an event is best effort; the status carries the same truth
            logging.getLogger(__name__).warning("could not post event %s on %s", reason, name)

    async def max_node_gpus(self) -> int | None:
        fetched, value = self.node_gpus
        if time.monotonic() - fetched > NODE_CACHE_SECONDS:
            value = await asyncio.to_thread(kube.max_node_gpus, self.core, GPU_RESOURCE)
            self.node_gpus = (time.monotonic(), value)
        return value


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "no node fits")
    return None


def _termination(pod: dict[str, Any]) -> tuple[str | None, WorkerReport | None]:
    """The container's termination message: a WorkerReport JSON if the worker wrote one."""
    for cs in pod.get("status", {}).get("containerStatuses", []):
        terminated = (cs.get("state") or {}).get("terminated")
        if not terminated:
            continue
        message = terminated.get("message") or terminated.get("reason") or ""
        try:
            return message, WorkerReport.model_validate_json(message)
        except ValidationError:
            code = terminated.get("exitCode")
            return f"worker exited with code {code}: {message}".strip(), None
    return None, None


async def observe_pod(
    state: OperatorState, pod: dict[str, Any], spec: ModelDeploymentSpec, model: str
) -> ObservedPod:
    meta, status = pod["metadata"], pod.get("status", {})
    labels = meta.get("labels", {})
    ip = status.get("podIP")
    address = host_port(ip, spec.runtime.port) if ip else None
    failure, report = _termination(pod)
    pod_ready = _pod_ready(pod)
    reachable = address is not None and may_contact(ip) and status.get("phase") == "Running"
    if report is None and reachable and address is not None:
        report = await fetch_report(state.http, address)
    probe = await _probe(state, meta["uid"], address, model, spec, pod_ready and reachable)
    observed = ObservedPod(
        name=meta["name"],
        replica=int(labels.get(REPLICA_LABEL, "0")),
        identity=labels.get(IDENTITY_LABEL, ""),
        role=role_of(labels),
        phase=status.get("phase", "Pending"),
        node=pod.get("spec", {}).get("nodeName"),
        pod_ip=ip,
        terminating=bool(meta.get("deletionTimestamp")),
        pod_ready=pod_ready,
        unschedulable=_unschedulable(pod),
        failure=failure,
        worker=report,
        probe=probe,
    )
    if observed.failed:
        failed_at = _finished_at(pod) or state.failures_seen.setdefault(
            meta["uid"], datetime.now(UTC)
        )
        observed = dataclasses.replace(observed, failed_at=failed_at)
    return observed


def _finished_at(pod: dict[str, Any]) -> datetime | None:
    for cs in pod.get("status", {}).get("containerStatuses", []):
        finished = ((cs.get("state") or {}).get("terminated") or {}).get("finishedAt")
        if finished:
            try:
                return parse_rfc3339(finished)
            except ValueError:
                return None
    return None


async def _probe(
    state: OperatorState,
    uid: str,
    address: str | None,
    model: str,
    spec: ModelDeploymentSpec,
    probe_now: bool,
) -> ProbeResult | None:
    """Probe a loaded replica: until it passes on every pass, then every periodSeconds."""
    last = state.probes.get(uid)
    if not probe_now or address is None:
        if last is not None and not probe_now:
            state.probes.pop(uid, None)  # not loaded (anymore): forget, it must pass again
        return None
    period = spec.probe.period_seconds if spec.probe else 10
    if last is not None and last[1].passed and time.monotonic() - last[0] < period:
        return last[1]
    result = await probe_inference(
        state.http, address, model, spec.probe, last[1] if last else None
    )
    state.probes[uid] = (time.monotonic(), result)
    return result


def _sibling_sources(published: list[Any], name: str) -> list[SourceEndpoint]:
    """Valid sources other ModelDeployments publish (planning matches the identity)."""
    sources: list[SourceEndpoint] = []
    for raw in published:
        try:
            source = SourceEndpoint.model_validate(raw)
        except ValidationError:
            continue
        if source.deployment != name:
            sources.append(source)
    return sources


def _previous_status(body: dict[str, Any]) -> ModelDeploymentStatus | None:
    if not body.get("status"):
        return None  # first pass: the first phase gets its Event too
    try:
        return ModelDeploymentStatus.model_validate(body["status"])
    except ValidationError:
        return None


def _status_patch(status: ModelDeploymentStatus) -> dict[str, Any]:
    """Merge-patch body: explicit nulls remove top-level fields that are no longer set."""
    patch = status.wire()
    for name, info in ModelDeploymentStatus.model_fields.items():
        key = info.alias or name
        if key not in patch:
            patch[key] = None
    return patch


def invalid_spec_status(
    body: dict[str, Any], error: ValidationError, previous: ModelDeploymentStatus | None
) -> ModelDeploymentStatus:
    """Failed/InvalidSpec naming the field; replicas, sources and progress stay as they were
    (the running pods keep serving until the spec is fixed)."""
    first = error.errors()[0]
    where = "spec." + ".".join(str(p) for p in first["loc"])
    message = f"{where}: {first['msg']}"
    ready = Condition(
        type="Ready",
        status="False",
        reason="InvalidSpec",
        message=message,
        last_transition_time=rfc3339(datetime.now(UTC)),
    )
    base = previous or ModelDeploymentStatus()
    kept = [c for c in base.conditions if c.type != "Ready"]
    return base.model_copy(
        update={
            "phase": Phase.FAILED,
            "message": message,
            "observed_generation": body["metadata"].get("generation"),
            "conditions": [*kept, ready],
        }
    )


async def reconcile(
    state: OperatorState,
    namespace: str,
    name: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    published_sources: list[Any],
) -> float:
    """One pass; returns seconds until the next one. `published_sources` are the raw
    status.sources entries of the namespace's ModelDeployments (the kopf index)."""
    body = await asyncio.to_thread(kube.get_deployment, state.custom, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return 5.0
    try:
        spec = ModelDeploymentSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        previous = _previous_status(body)
        status = invalid_spec_status(body, exc, previous)
        unchanged = (
            previous is not None
            and previous.phase == status.phase
            and previous.message == status.message
        )
        if unchanged and previous is not None:
            status.conditions = previous.conditions  # keep lastTransitionTime
        patch = _status_patch(status)
        if {k: v for k, v in patch.items() if v is not None} != body.get("status"):
            await asyncio.to_thread(kube.patch_status, state.custom, namespace, name, patch)
        logger.warning("invalid spec: %s", status.message)
        if not unchanged:  # the contract: log, post an Event, go on with the others
            try:
                await asyncio.to_thread(
                    kube.post_event, state.core, body, "Warning", "InvalidSpec", status.message
                )
            except Exception:  # best effort: the status says the same
                logger.warning("could not post event InvalidSpec")
        return 30.0
    model = spec.model.name or name
    pods, max_gpus = await asyncio.gather(
        asyncio.to_thread(kube.list_pods, state.core, namespace, f"{DEPLOYMENT_LABEL}={name}"),
        state.max_node_gpus(),
    )
    uid = body["metadata"]["uid"]
    owned = [
        p
        for p in pods
        if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences", []))
    ]
    observed_pods = await asyncio.gather(*(observe_pod(state, p, spec, model) for p in owned))
    observed = Observed(
        name=name,
        namespace=namespace,
        generation=body["metadata"].get("generation", 0),
        now=datetime.now(UTC),
        pods=list(observed_pods),
        sibling_sources=_sibling_sources(published_sources, name),
        previous=_previous_status(body),
        max_node_gpus=max_gpus,
    )
    result = plan(spec, observed)
    await apply(state, body, spec, result, logger)
    return result.requeue_after


def _surface_rejection(result: Plan, message: str, previous: dict[str, Any]) -> None:
    """The API server refused a pod (quota, admission, missing ServiceAccount): say so in the
    status and once as an Event, instead of failing the whole reconcile."""
    status = result.status
    status.message = message
    for condition in status.conditions:
        if condition.type == "Scheduled":
            condition.status, condition.reason, condition.message = "False", "FailedCreate", message
    if previous.get("message") != message:
        result.events.append(Event("Warning", "FailedCreate", message))


async def apply(
    state: OperatorState,
    body: dict[str, Any],
    spec: ModelDeploymentSpec,
    result: Plan,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    for pod, reason in result.delete.items():
        logger.info("deleting pod %s: %s", pod, reason)
        await asyncio.to_thread(kube.delete_pod, state.core, namespace, pod)
    for pod, role in result.relabel.items():
        await asyncio.to_thread(
            kube.patch_pod_labels, state.core, namespace, pod, {ROLE_LABEL: str(role)}
        )
    rejected: list[str] = []
    for desired in result.create:
        manifest = render_pod(name, namespace, uid, spec, desired)
        try:
            if await asyncio.to_thread(kube.create_pod, state.core, namespace, manifest):
                logger.info("created %s pod %s", desired.role, desired.name)
        except ApiException as exc:
            rejected.append(f"creating pod {desired.name} was rejected: {kube.api_error(exc)}")
    if rejected:
        _surface_rejection(result, rejected[0], body.get("status") or {})
    previous = body.get("status") or {}
    patch = _status_patch(result.status)
    if {k: v for k, v in patch.items() if v is not None} != previous:
        await asyncio.to_thread(kube.patch_status, state.custom, namespace, name, patch)
    for event in result.events:
        try:
            await asyncio.to_thread(
                kube.post_event, state.core, body, event.type, event.reason, event.message
            )
        except Exception:  # best effort: the status says the same
            logger.warning("could not post event %s", event.reason)
