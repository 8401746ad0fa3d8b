"""One reconcile pass: observe (API objects, worker reports, probes) -> plan -> apply."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from weightlift.api.labels import (
    IDENTITY_LABEL,
    INFERENCE_PROBE_GATE,
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    PEERS_ANNOTATION,
    PLAN_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
    SERVING_LABEL,
    SPARE_LABEL,
    TEMPLATE_LABEL,
    WOKEN_ANNOTATION,
    published_sources_selector,
)
from weightlift.api.model import (
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    ProbeResult,
    Role,
    RuntimeType,
    SourceEndpoint,
    pulls_from_peers,
)
from weightlift.api.times import parse_rfc3339, rfc3339
from weightlift.api.worker import PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator import applygate, kube, podsecurity, serving
from weightlift.operator.groups import (
    collapse,
    group_actions,
    group_index,
    render_lws,
    spread_handoffs,
)
from weightlift.operator.identity import model_identity, pod_template_revision
from weightlift.operator.inject import injection_failure
from weightlift.operator.metrics import engine_of
from weightlift.operator.planning import (
    POLL_PENDING,
    DesiredPod,
    Event,
    Observed,
    ObservedPod,
    Plan,
    SpecError,
    host_port,
    plan,
    pod_name,
)
from weightlift.operator.pods import compile_store_volume, plan_for, render_pod, role_of
from weightlift.operator.podtemplate import TemplateConflict
from weightlift.operator.probes import (
    fetch_report,
    probe_inference,
)
from weightlift.operator.shared_objects import (
    PlanConfigMap,
    configmap_manifest,
    sweep_selector,
    token_secret_manifest,
)
from weightlift.operator.state import OperatorState
from weightlift.operator.statuswrites import write_in
from weightlift.operator.transitions import record_pass

# Probe times change on every probe. When nothing else in the status did, they are written at
# most this often: 1000 deployments probed every 10 s would otherwise patch 100 statuses a second
# (and each patch comes back to kopf's watch). Any other change is written at once.
PROBE_TIME_REFRESH_SECONDS = 120.0
# A serving worker whose pod stays Ready and whose probes pass has nothing new to report: its
# report is read again at most this often (or each probe period, if longer). A failing probe
# or a pod that is not Ready reads it at once. At 1000 x 4 with 10 s probes the re-read with
# every probe was half of the operator's steady-state requests and CPU.
REPORT_REFRESH_SECONDS = 60.0


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    """The worker container is ready (the kubelet's ContainersReady): hooks ran, weights bound.
    Not the pod's Ready, which also waits for the inference-probe gate this operator sets after
    probing (probing only Ready pods would wait forever)."""
    conditions = {
        c.get("type"): c.get("status") for c in pod.get("status", {}).get("conditions", [])
    }
    return conditions.get("ContainersReady", conditions.get("Ready")) == "True"


def _probe_gate(pod: Mapping[str, Any]) -> bool | None:
    """The inference-probe gate's condition (absent: False); None when the pod has no such gate."""
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    if not any(g.get("conditionType") == INFERENCE_PROBE_GATE for g in gates):
        return None
    return any(
        c.get("type") == INFERENCE_PROBE_GATE and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "no node fits")
    return None


# The kubelet's reasons for a container that cannot start, as it sets them in
# containerStatuses[].state.waiting (pkg/kubelet/images, kuberuntime): each holds the replica back
# until someone fixes the image, the secret or the config. ContainerCreating and
# PodInitializing are progress, not problems.
STUCK_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)


def _stuck(pod: Mapping[str, Any]) -> str | None:
    """Why the worker container cannot start, naming its image: "image X: ImagePullBackOff
    (the kubelet's message)"; None while it starts or runs."""
    for cs in pod.get("status", {}).get("containerStatuses", []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            detail = f" ({waiting['message']})" if waiting.get("message") else ""
            return f"image {cs.get('image')}: {waiting['reason']}{detail}"
    return None


def _termination(
    pod: dict[str, Any], state: str = "state"
) -> tuple[str | None, WorkerReport | None]:
    """The container's termination message: a WorkerReport JSON if the worker wrote one.
    `state`: "lastState" for the run before a restart in place."""
    if state == "state" and (evicted := _evicted(pod.get("status", {}))):
        return f"evicted by the kubelet: {evicted['message'] or 'no reason given'}", None
    for cs in pod.get("status", {}).get("containerStatuses", []):
        terminated = (cs.get(state) or {}).get("terminated")
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
    failure, report = injection_failure(pod) or _termination(pod)
    # A group's pod restarts in place (restartPolicy None in its set): its last run says why.
    restarts = sum(cs.get("restartCount") or 0 for cs in status.get("containerStatuses") or [])
    if failure is None and restarts:
        failure = _termination(pod, "lastState")[0]
    pod_ready = _pod_ready(pod)
    state.index_shows(meta["uid"], meta)
    reachable = (
        address is not None and state.settings.may_contact(ip) and status.get("phase") == "Running"
    )
    if report is None and reachable and address is not None:
        report = await _report(state, meta["uid"], address, spec, pod_ready)
    # A group is probed through its leader, whose answer its whole group computes.
    probed = pod_ready and reachable and group_index(pod) in (None, 0)
    probe = await _probe(state, meta["uid"], address, model, spec, probed)
    observed = ObservedPod(
        name=meta["name"],
        replica=int(labels.get(REPLICA_LABEL) or labels.get(LWS_GROUP_INDEX_LABEL) or "0"),
        identity=labels.get(IDENTITY_LABEL, ""),
        role=role_of(labels),
        phase=status.get("phase", "Pending"),
        node=pod.get("spec", {}).get("nodeName"),
        pod_ip=ip,
        terminating=bool(meta.get("deletionTimestamp")),
        pod_ready=pod_ready,
        unschedulable=_unschedulable(pod),
        stuck=_stuck(pod),
        failure=failure,
        worker=report,
        probe=probe,
        handoff=PeerHandoff.parse((meta.get("annotations") or {}).get(PEERS_ANNOTATION)),
        spare=labels.get(SPARE_LABEL) == "true",
        serving_labelled=labels.get(SERVING_LABEL) == "true",
        probe_gate=_probe_gate(pod),
        container_restarts=restarts,
        template=labels.get(TEMPLATE_LABEL),
    )
    if observed.failed:
        record = state.pod(meta["uid"])
        if record.failure_seen is None:
            record.failure_seen = datetime.now(UTC)
        failed_at = _finished_at(pod) or record.failure_seen
        observed = dataclasses.replace(observed, failed_at=failed_at)
    return observed


def _finished_at(pod: dict[str, Any]) -> datetime | None:
    for cs in pod.get("status", {}).get("containerStatuses", []):
        ended = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
            "terminated"
        )
        finished = (ended or {}).get("finishedAt")
        if finished:
            try:
                return parse_rfc3339(finished)
            except ValueError:
                return None
    return None


async def _report(
    state: OperatorState, uid: str, address: str, spec: ModelDeploymentSpec, pod_ready: bool
) -> WorkerReport | None:
    """The worker's report. A serving worker's report stays as it is until the worker stops
    serving: while its pod stays Ready and its probes pass, the last one is reused (see
    REPORT_REFRESH_SECONDS)."""
    last = state.pod(uid).report
    if last is not None and pod_ready and _probe_passing(state, uid):
        period = spec.probe.period_seconds if spec.probe else 10
        if time.monotonic() - last[0] < max(REPORT_REFRESH_SECONDS, period):
            return WorkerReport.model_validate_json(last[1])
    report = await fetch_report(state.http, address)
    if report is not None and report.phase == WorkerPhase.SERVING and pod_ready:
        state.pod(uid).report = (time.monotonic(), report.model_dump_json().encode())
    else:
        state.pod(uid).report = None
    return report


def _probe_passing(state: OperatorState, uid: str) -> bool:
    last = state.pod(uid).probe
    return last is not None and last[1].passed


def _probe_due(state: OperatorState, uid: str, spec: ModelDeploymentSpec) -> bool:
    """No passing probe of the pod, or its period ran out."""
    last = state.pod(uid).probe
    period = spec.probe.period_seconds if spec.probe else 10
    return last is None or not last[1].passed or time.monotonic() - last[0] >= period


async def _probe(
    state: OperatorState,
    uid: str,
    address: str | None,
    model: str,
    spec: ModelDeploymentSpec,
    probe_now: bool,
) -> ProbeResult | None:
    """Probe a loaded replica: until it passes on every pass, then every periodSeconds."""
    record = state.pod(uid)
    last = record.probe
    if not probe_now or address is None:
        if last is not None and not probe_now:
            record.probe = None  # not loaded (anymore): forget, it must pass again
        return None
    if last is not None and not _probe_due(state, uid, spec):
        return last[1]
    result = await probe_inference(
        state.http, address, model, spec.probe, last[1] if last else None, spec.runtime
    )
    record.probe = (time.monotonic(), result)
    state.metrics.probed(engine_of(spec), result.passed)
    return result


def published_by(md: Mapping[str, Any]) -> list[Any]:
    """The sources a ModelDeployment's status publishes; none once it is being deleted: its
    finalizer keeps the object (and its last status) until its pods are gone, and a new
    deployment of the model must not be handed a source on its way out."""
    if (md.get("metadata") or {}).get("deletionTimestamp"):
        return []
    return list((md.get("status") or {}).get("sources") or [])


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


def _previous_status(raw: dict[str, Any] | None) -> ModelDeploymentStatus | None:
    if not raw:
        return None  # first pass: the first phase gets its Event too
    try:
        return ModelDeploymentStatus.model_validate(raw)
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


def parse_spec(raw: Any) -> ModelDeploymentSpec | SpecError:
    """The spec, or what is wrong with it (first error, named by its path under spec)."""
    try:
        return ModelDeploymentSpec.model_validate(raw or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(["spec", *(str(p) for p in first["loc"])])
        return SpecError(f"{where}: {first['msg']}")


def pod_essentials(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a Pod that observe_pod reads: what the pod index keeps in memory (a whole
    Pod is ~10x bigger, and an operator holds thousands)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    created = meta.get("creationTimestamp")
    terminated = [
        {"state": {"terminated": _slim_termination((cs.get("state") or {})["terminated"])}}
        for cs in status.get("containerStatuses") or []
        if (cs.get("state") or {}).get("terminated")
    ]
    # A group's pod restarts in place: how often, and why its last run ended.
    restarted = [
        {
            "restartCount": cs["restartCount"],
            "lastState": {
                "terminated": _slim_termination(
                    ((cs.get("lastState") or {}).get("terminated")) or {}
                )
            },
        }
        for cs in status.get("containerStatuses") or []
        if cs.get("restartCount")
    ]
    stuck = [
        {"image": cs.get("image"), "state": {"waiting": cs["state"]["waiting"]}}
        for cs in status.get("containerStatuses") or []
        if ((cs.get("state") or {}).get("waiting") or {}).get("reason") in STUCK_REASONS
    ]
    # Only the conditions a pass reads (Ready, ContainersReady, PodScheduled, the gate), only
    # the fields it reads: the probe and transition times kubelets rewrite are most of a
    # condition's bytes.
    conditions = [
        {key: c[key] for key in ("type", "status", "reason", "message") if c.get(key)}
        for c in status.get("conditions") or []
        if c.get("type") in ("Ready", "ContainersReady", "PodScheduled", INFERENCE_PROBE_GATE)
    ]
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    kept = {key: annotations[key] for key in POD_ANNOTATIONS_READ if key in annotations}
    return {
        "metadata": {
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            **({"creationTimestamp": created} if created else {}),  # time to Ready (metrics)
            "labels": {key: labels[key] for key in POD_LABELS_READ if key in labels},
            **({"annotations": kept} if kept else {}),
            **(
                {"deletionTimestamp": meta["deletionTimestamp"]}
                if "deletionTimestamp" in meta
                else {}
            ),
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            **({"readinessGates": spec["readinessGates"]} if spec.get("readinessGates") else {}),
        },
        "status": {
            "phase": status.get("phase", "Pending"),
            "podIP": status.get("podIP"),
            "conditions": conditions,
            "containerStatuses": terminated + restarted + stuck,
            **_evicted(status),
        },
    }


def _evicted(status: Mapping[str, Any]) -> dict[str, str]:
    """The kubelet's eviction (pod reason Evicted and its message): the worker's own exit
    (137, SIGKILL) would not say that the node ran short of disk or memory."""
    if status.get("reason") != "Evicted":
        return {}
    return {"reason": "Evicted", "message": str(status.get("message") or "")}


# The pod labels a pass reads (observe_pod, pods.role_of, _sweep_plans).
POD_LABELS_READ = (
    REPLICA_LABEL,
    IDENTITY_LABEL,
    ROLE_LABEL,
    PLAN_LABEL,
    SPARE_LABEL,
    SERVING_LABEL,
    TEMPLATE_LABEL,
    LWS_GROUP_INDEX_LABEL,
    LWS_WORKER_INDEX_LABEL,
    LWS_NAME_LABEL,  # a group's set: groups.collapse names the group by it
)
POD_ANNOTATIONS_READ = (PEERS_ANNOTATION, WOKEN_ANNOTATION)


def _slim_termination(terminated: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: terminated[key]
        for key in ("message", "reason", "exitCode", "finishedAt")
        if key in terminated
    }


async def reconcile(
    state: OperatorState,
    live_body: Mapping[str, Any],
    pods: list[dict[str, Any]],
    sources_of: Callable[[str], list[Any]],
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> float:
    """One pass; returns seconds until the next one. Reads nothing from the API server:
    `live_body` is kopf's live view of the ModelDeployment, `pods` its pods from kopf's pod
    index, `sources_of(identity)` the sources the namespace's ModelDeployments publish for a
    model identity (kopf's index)."""
    body = dict(live_body)  # one consistent snapshot: kopf swaps the live body on each event
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return 5.0  # the finalizer handler owns deletion
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    if state.awaited_pods(uid, {p["metadata"]["name"] for p in pods}):
        return 1.0  # pods just created are not in the index yet; their events wake us
    spec = parse_spec(body.get("spec"))
    state.deployment(uid).generation = meta.get("generation")
    observed_pods: list[ObservedPod] = []
    max_gpus = None
    previous = state.status_of(uid, body) or {}  # parsed once a pass: apply compares with it
    siblings: list[SourceEndpoint] = []
    if not isinstance(spec, SpecError):
        siblings = _sibling_sources(sources_of(model_identity(spec)), name)
        model = spec.model.name or name
        observed_pods, max_gpus = await asyncio.gather(
            asyncio.gather(*(observe_pod(state, p, spec, model) for p in pods)),
            state.max_node_gpus(spec.template.gpu_resource),
        )
        woken = state.still_spare_labelled(uid, {p.name for p in observed_pods if p.spare})
        observed_pods = [
            dataclasses.replace(p, spare=False) if p.name in woken else p for p in observed_pods
        ]
        if any(group_index(p) is not None for p in pods):
            size = spec.parallelism.pods_per_replica
            observed_pods = collapse(zip(pods, observed_pods, strict=True), size)
    observed = Observed(
        name=name,
        namespace=namespace,
        generation=meta.get("generation", 0),
        now=datetime.now(UTC),
        pods=list(observed_pods),
        sibling_sources=siblings,
        previous=_previous_status(previous),
        max_node_gpus=max_gpus,
        model_path_prefixes=state.settings.model_path_prefixes,
    )
    result = plan(spec, observed)
    if not isinstance(spec, SpecError) and _starts_storage_load(spec, result):
        result = await _replan_with_published_sources(state, spec, observed, result)
    if isinstance(spec, SpecError):
        logger.warning("invalid spec: %s", spec.message)
    applying = time.time()
    groups = {p.name: p for p in observed_pods if p.members}
    await apply(state, body, spec, result, logger, previous, pods, groups)
    record_pass(state, uid, spec, result, previous, list(observed_pods), pods, applying)
    return result.requeue_after


def _only_probe_times_moved(
    state: OperatorState, uid: str, written: Mapping[str, Any], previous: Mapping[str, Any]
) -> bool:
    """True when the new status differs from the last one written only in probe times and
    latencies, and that write is recent (see PROBE_TIME_REFRESH_SECONDS)."""
    last = state.deployment(uid).written_at
    if last is None or time.monotonic() - last >= PROBE_TIME_REFRESH_SECONDS:
        return False
    return _without_probe_times(written) == _without_probe_times(previous)


def _without_probe_times(status: Mapping[str, Any]) -> dict[str, Any]:
    volatile = ("lastProbeTime", "latencyMs")
    replicas = [
        {**r, "probe": {k: v for k, v in r["probe"].items() if k not in volatile}}
        if isinstance(r.get("probe"), dict)
        else r
        for r in status.get("replicaStatuses") or []
    ]
    return {**status, "replicaStatuses": replicas}


async def _replan_with_published_sources(
    state: OperatorState, spec: ModelDeploymentSpec, observed: Observed, result: Plan
) -> Plan:
    """kopf's index trails the API server by a batch window or more: a sibling may already
    publish a Ready source of this identity that the index has not seen. A storage load is slow
    and a pull is fast, so before deciding on one, ask the API server: a field-selected LIST
    of the few ModelDeployments that publish this identity."""
    if result.status.model_identity is None:
        return result
    fresh = await asyncio.to_thread(
        kube.list_deployments,
        state.custom,
        observed.namespace,
        published_sources_selector(result.status.model_identity),
    )
    published = [raw for md in fresh for raw in published_by(md)]
    known = {(s.deployment, s.pod) for s in observed.sibling_sources}
    unseen = [
        s for s in _sibling_sources(published, observed.name) if (s.deployment, s.pod) not in known
    ]
    if not unseen:
        return result
    return plan(
        spec, dataclasses.replace(observed, sibling_sources=[*observed.sibling_sources, *unseen])
    )


def _starts_storage_load(spec: ModelDeploymentSpec, result: Plan) -> bool:
    """The plan creates a replica that loads from storage although it could pull from a peer."""
    return pulls_from_peers(spec.loading, spec.runtime) and (
        any(d.role == Role.SOURCE for d in result.create)
        or any(h.storage for h in result.handoff.values())
    )


async def _patch_pods(
    state: OperatorState,
    namespace: str,
    result: Plan,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    uids: Mapping[str, str] | None = None,
) -> None:
    """Relabels and hand-offs (the weightlift.dev/peers annotation the kubelet projects into a
    waiting Target's hand-off file), one merge patch per pod, all at once: a Target in standby
    starts pulling as soon as its file changes. `uids`: pod name -> uid, from the index; a
    patch just sent that the index does not show yet is not sent again (state.should_patch)."""
    uids = uids or {}
    patches: dict[str, dict[str, Any]] = {}
    for pod, role in result.relabel.items():
        patches.setdefault(pod, {})["labels"] = {ROLE_LABEL: str(role)}
    woken_at = rfc3339(datetime.now(UTC))
    for pod in result.unspare:  # null removes the label (merge patch); with its hand-off
        patches.setdefault(pod, {}).setdefault("labels", {})[SPARE_LABEL] = None
        patches[pod].setdefault("annotations", {})[WOKEN_ANNOTATION] = woken_at
    for pod, handoff in result.handoff.items():
        patches.setdefault(pod, {}).setdefault("annotations", {})[PEERS_ANNOTATION] = (
            handoff.to_text()
        )
    for pod in result.serve:  # mostly with its hand-off: the same patch
        patches.setdefault(pod, {}).setdefault("labels", {})[SERVING_LABEL] = "true"
    for pod, revision in result.adopt.items():
        patches.setdefault(pod, {}).setdefault("labels", {})[TEMPLATE_LABEL] = revision

    async def patch(pod: str, metadata: dict[str, Any]) -> None:
        if not state.should_patch(uids.get(pod), metadata):
            return
        if (handoff := result.handoff.get(pod)) is not None:
            what = "storage" if handoff.storage else ", ".join(c.pod for c in handoff.peers)
            logger.info("handing %s to pod %s", what, pod)
        try:
            await asyncio.to_thread(kube.patch_pod_metadata, state.core, namespace, pod, metadata)
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile needs nothing
                raise
            return
        state.patched(uids.get(pod), metadata)

    await asyncio.gather(*(patch(pod, metadata) for pod, metadata in patches.items()))


def _surface_rejection(result: Plan, message: str, previous: Mapping[str, Any]) -> None:
    """The API server refused a pod (quota, admission, missing ServiceAccount): say so in the
    status and once as an Event, instead of failing the whole reconcile."""
    status = result.status
    status.message = message
    # Retried at the pending poll, not the steady one: once the cause is fixed (RBAC granted,
    # quota freed) the replica comes within seconds.
    result.requeue_after = min(result.requeue_after, POLL_PENDING)
    for condition in status.conditions:
        if condition.type == "Scheduled":
            condition.status, condition.reason, condition.message = "False", "FailedCreate", message
    if previous.get("message") != message:
        result.events.append(Event("Warning", "FailedCreate", message))


async def _ensure_beside_pods(
    state: OperatorState,
    meta: Mapping[str, Any],
    spec: ModelDeploymentSpec,
    identity: str,
    plan: PlanConfigMap,
) -> None:
    """The plan ConfigMap and the P2P token Secret exist before a pod that mounts them."""
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    record = state.deployment(uid)
    writes: list[Coroutine[Any, Any, object]] = []
    if plan.name not in record.plan_maps:
        manifest = configmap_manifest(plan, namespace, name, uid)
        writes.append(asyncio.to_thread(kube.create_configmap, state.core, namespace, manifest))
    if spec.runtime.type != RuntimeType.EXTERNAL and identity not in record.tokens:
        secret = token_secret_manifest(identity, namespace, name, uid)
        writes.append(asyncio.to_thread(kube.ensure_owned_secret, state.core, namespace, secret))
    await asyncio.gather(*writes)  # independent: at once
    record.plan_maps.add(plan.name)
    if spec.runtime.type != RuntimeType.EXTERNAL:
        record.tokens.add(identity)


async def _sweep_plans(
    state: OperatorState,
    meta: Mapping[str, Any],
    pods: list[dict[str, Any]],
    spec: ModelDeploymentSpec,
    identity: str | None,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Delete older revisions' plan ConfigMaps once no pod of this deployment uses them (one
    deletecollection per rollover; nothing at all while no older plan was seen)."""
    record = state.deployment(meta["uid"])
    in_use: set[str] = {
        str(label)
        for p in pods
        if (label := (p["metadata"].get("labels") or {}).get(PLAN_LABEL)) is not None
    }
    if len(in_use) != 1 or not identity:
        if len(in_use) > 1:
            record.stale_plans = True
        return
    (label,) = in_use
    if record.plan_label is None:
        record.plan_label = label
    elif record.plan_label != label:
        record.plan_label = label
        record.stale_plans = True
    if not record.stale_plans:
        return  # cheap: the plan is not recomputed on every pass
    if label != plan_for(meta["name"], meta["namespace"], spec, identity).label:
        return  # only pods of an older revision are left; its successors are on their way
    record.stale_plans = False
    selector = sweep_selector(meta["name"], {label})
    try:
        await asyncio.to_thread(kube.delete_configmaps, state.core, meta["namespace"], selector)
    except ApiException as exc:
        record.stale_plans = True  # the next pass tries again
        logger.warning("sweeping old plan ConfigMaps: %s", kube.api_error(exc))


# A set just made counts as existing this long, before its pods reach the pod index.
LWS_JUST_MADE_SECONDS = 30.0


async def _apply_groups(
    state: OperatorState,
    meta: Mapping[str, Any],
    spec: ModelDeploymentSpec,
    result: Plan,
    groups: Mapping[str, ObservedPod],
    logger: logging.Logger | logging.LoggerAdapter[Any],
    pods: list[dict[str, Any]],
) -> list[str]:
    """Multi-pod replicas, one LeaderWorkerSet each: planning's creations make sets, its
    scale-downs and roll-overs delete the sets it chose, its replacements of failed groups
    delete their leaders (LWS recreates the group). Nothing is left for apply to create.
    Returns what the API server refused."""
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    record = state.deployment(uid)
    # Sets that exist: their pods' label (terminating ones too), or made a moment ago.
    now = time.monotonic()
    existing = {
        str(labels[LWS_NAME_LABEL])
        for raw in pods
        if LWS_NAME_LABEL in (labels := (raw.get("metadata") or {}).get("labels") or {})
    } | {s for s, made in record.lws.items() if now - made < LWS_JUST_MADE_SECONDS}
    prefix = pod_name(name, model_identity(spec), 0)[:-1]
    template = pod_template_revision(spec)
    actions = group_actions(groups, result, existing, spec.replicas, prefix, template)
    result.create = []
    for pod, why in actions.delete_pods.items():
        logger.info("deleting group leader %s (LWS recreates its group): %s", pod, why)
        await asyncio.to_thread(kube.delete_pod, state.core, namespace, pod)
    for set_name, why in actions.delete_sets.items():
        logger.info("deleting LeaderWorkerSet %s: %s", set_name, why)
        try:
            await asyncio.to_thread(kube.delete_lws, state.custom, namespace, set_name)
        except ApiException as exc:
            return [f"deleting LeaderWorkerSet {set_name} was rejected: {kube.api_error(exc)}"]
        record.lws.pop(set_name, None)
    for desired in actions.create:
        # The plan (JSON + sha256) once per set made, not on every pass.
        plan = plan_for(name, namespace, spec, desired.identity)
        manifest = render_lws(
            name, namespace, uid, spec, desired, plan, state.settings_for(namespace)
        )
        set_name = manifest["metadata"]["name"]
        try:
            await _ensure_beside_pods(state, meta, spec, desired.identity, plan)
            # A set that exists (made by an earlier pass or operator, its pods not seen yet,
            # or still being deleted) is left as it is: a later pass sees its group or makes it.
            if await asyncio.to_thread(kube.create_lws, state.custom, namespace, manifest):
                logger.info("LeaderWorkerSet %s made", set_name)
        except ApiException as exc:
            return [f"LeaderWorkerSet {set_name} was rejected: {kube.api_error(exc)}"]
        except TemplateConflict as exc:
            return [f"LeaderWorkerSet {set_name} was not created: {exc}"]
        record.lws[set_name] = time.monotonic()
    return []


async def _create_pods(
    state: OperatorState,
    meta: Mapping[str, Any],
    spec: ModelDeploymentSpec,
    create: list[DesiredPod],
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> list[str]:
    """Each identity's plan and token first, then the pods all at once: one after another, a
    4-replica deployment's creates took ~4 round trips of a busy API server (~1 s each in a
    1000-deployment ramp) before its last pod existed. Returns what was rejected."""
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rejected: list[str] = []
    plans: dict[str, PlanConfigMap] = {}  # identity -> this revision's plan, once it exists
    for desired in create:
        if desired.identity in plans:
            continue
        plan = plan_for(name, namespace, spec, desired.identity)
        try:
            await _ensure_beside_pods(state, meta, spec, desired.identity, plan)
        except ApiException as exc:
            why = kube.api_error(exc)
            return [*rejected, f"creating {plan.name} for pod {desired.name} was rejected: {why}"]
        plans[desired.identity] = plan

    exist: list[str] = []

    async def create_one(desired: DesiredPod) -> None:
        plan = plans[desired.identity]
        for attempt in (1, 2):
            try:
                created = await asyncio.to_thread(
                    _create_pod, state, name, namespace, uid, spec, desired, plan
                )
                break
            except TemplateConflict as exc:  # a template clash only the render can see
                rejected.append(f"pod {desired.name} was not created: {exc}")
                return
            except ApiException as exc:
                why = kube.api_error(exc)
                if podsecurity.refused_by_pod_security(why):
                    if attempt == 1 and await _drop_node_store(state, meta, spec):
                        continue  # once more, without the hostPath store
                    why = podsecurity.refusal_message(spec, namespace, why)
                rejected.append(f"creating pod {desired.name} was rejected: {why}")
                return
        state.await_pod(uid, desired.name)  # new, or already there (409): it exists
        exist.append(desired.name)
        if created:
            what = "spare" if desired.spare else desired.role
            logger.info("created %s pod %s", what, desired.name)

    gate = applygate.claim(name) if len(create) > 1 else None
    if gate is not None:  # a live test's hold (applygate.py; never in a pod): the first alone
        await create_one(create[0])
        pending = [d.name for d in create[1:]]
        await applygate.hold(gate, applygate.Held(name, os.getpid(), list(exist), pending))
        create = create[1:]
    await asyncio.gather(*(create_one(d) for d in create))
    return rejected


async def _drop_node_store(
    state: OperatorState, meta: Mapping[str, Any], spec: ModelDeploymentSpec
) -> bool:
    """After a PodSecurity refusal: render the namespace's pods without the node compile store
    (a hostPath) from now on, and say so once. False when that cannot help: the spec's pods
    have no store (the refusal is the spec's own)."""
    namespace = meta["namespace"]
    if compile_store_volume(spec, state.settings) is None:
        return False
    if namespace not in state.no_node_store:
        state.no_node_store.add(namespace)
        message = podsecurity.node_store_off_message(namespace, state.settings.compile_store)
        reason = podsecurity.NODE_STORE_OFF_REASON
        await state.post_event({"metadata": meta}, "Warning", reason, message)
    return True


def _create_pod(
    state: OperatorState,
    name: str,
    namespace: str,
    uid: str,
    spec: ModelDeploymentSpec,
    desired: DesiredPod,
    plan: PlanConfigMap,
) -> bool:
    """Render and create, in the API thread: a manifest exists only while it is sent (~11 KB of
    Python objects each; rendered before the thread hop, a rollout of 1000 deployments queued
    1000 of them behind the API threads)."""
    manifest = render_pod(name, namespace, uid, spec, desired, plan, state.settings_for(namespace))
    return kube.create_pod(state.core, namespace, manifest)


async def apply(
    state: OperatorState,
    body: dict[str, Any],
    spec: ModelDeploymentSpec | SpecError,
    result: Plan,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    previous: Mapping[str, Any],
    pods: list[dict[str, Any]] | None = None,
    groups: Mapping[str, ObservedPod] | None = None,
) -> None:
    """Apply the plan; `previous` is the status last planned (state.status_of). The status is
    written through here only, at once or coalesced (statuswrites.py). `groups`: multi-pod
    replicas by leader name (groups.py), whose pods LeaderWorkerSets create and delete."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    groups = groups or {}
    for pod, reason in result.delete.items():
        if pod in groups:
            continue  # _apply_groups
        logger.info("deleting pod %s: %s", pod, reason)
        await asyncio.to_thread(kube.delete_pod, state.core, namespace, pod)
    rejected: list[str] = []
    if isinstance(spec, ModelDeploymentSpec) and (groups or spec.parallelism.pods_per_replica > 1):
        spread_handoffs(result, groups, spec.parallelism.pods_per_replica, spec.runtime.port)
        rejected += await _apply_groups(state, meta, spec, result, groups, logger, pods or [])
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods or []}
    await _patch_pods(state, namespace, result, logger, uids)
    await serving.set_gates(state, namespace, result, uids, logger)
    if isinstance(spec, ModelDeploymentSpec):
        refused = await serving.ensure_service(state, meta, spec, logger)
        rejected += [refused] if refused else []
    state.woke_spares(uid, result.unspare)
    if result.create:
        assert not isinstance(spec, SpecError)  # plan creates nothing from an unparsable spec
        rejected += await _create_pods(state, meta, spec, result.create, logger)
    if not isinstance(spec, SpecError) and pods:
        await _sweep_plans(state, meta, pods, spec, result.status.model_identity, logger)
    if rejected:
        # A forbidden or refused request names its verb and resource (the API server's words).
        logger.warning("%s", rejected[0])
        _surface_rejection(result, rejected[0], previous)
    patch = _status_patch(result.status)
    planned = {k: v for k, v in patch.items() if v is not None}
    record = state.deployment(uid)
    if record.pending or (
        planned != previous and not _only_probe_times_moved(state, uid, planned, previous)
    ):
        since = time.monotonic() - (record.written_at or 0.0)
        left = write_in(planned, record.written_key, since)
        if left > 0:
            state.held_status(uid, planned)
            result.requeue_after = min(result.requeue_after, left)
        else:
            await asyncio.to_thread(kube.patch_status, state.custom, namespace, name, patch)
            state.wrote_status(uid, planned)
    for event in result.events:
        await state.post_event(body, event.type, event.reason, event.message)
