"""Planning: a pure function from (spec, observed state) to desired pod changes and status.

Handlers gather observations, call `plan`, apply the difference and patch the status; every
decision about roles, scaling, rollover and phases lives here so it can be tested exhaustively.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from weightlift.api.labels import DEPLOYMENT_LABEL, MAX_NAME_LENGTH, SPARE_LABEL
from weightlift.api.model import (
    DEFAULT_REVISION,
    GROUP_SPARES_MESSAGE,
    Condition,
    ConditionType,
    Engine,
    GroupPodStatus,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    ProbeResult,
    RankTransport,
    ReplicaStatus,
    Role,
    RuntimeType,
    SourceEndpoint,
    pulls_from_peers,
)
from weightlift.api.times import parse_rfc3339, rfc3339
from weightlift.api.uri import (
    REMOTE_SCHEMES,
    ModelUri,
    hf_repo,
    is_local_path,
    path_allowed,
)
from weightlift.api.worker import PeerCandidate, PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator.identity import model_identity, pod_template_revision
from weightlift.operator.service import service_status

# How soon to look again while something is in motion (seconds).
POLL_WHILE_LOADING = 2.0
# Pending pods, pods being created or deleted and a source this deployment waits for change
# through pod events, which wake the reconcile loop at once: a poll is only a safety net. At
# 1000 deployments a 2 s poll for them alone was 500 passes a second.
POLL_PENDING = 10.0
POLL_STEADY = 30.0
# Replacing a replica that keeps failing: 10 s, 20 s, 40 s ... at most 5 minutes.
BACKOFF_BASE = 10.0
BACKOFF_MAX = 300.0

SUPPORTED_STORAGE = ("hostpath", "file", "pvc", "s3", "hf")


@dataclass(frozen=True)
class ObservedPod:
    """One worker pod as the handlers saw it (pod object + worker report + probe result)."""

    name: str
    replica: int
    identity: str
    role: Role
    phase: str = "Pending"  # the pod's phase: Pending, Running, Succeeded, Failed, Unknown
    node: str | None = None
    pod_ip: str | None = None
    terminating: bool = False
    # The worker container's readiness probe passed (ContainersReady): hooks ran, weights bound.
    # Not the pod's Ready, which waits for the inference-probe gate this operator sets.
    pod_ready: bool = False
    unschedulable: str | None = None  # the scheduler's message while PodScheduled is False
    stuck: str | None = None  # why its container cannot start (an image pull, its config)
    failure: str | None = None  # why the container terminated, if it did
    failed_at: datetime | None = None  # when it failed (exit time, or first seen failed)
    worker: WorkerReport | None = None
    probe: ProbeResult | None = None
    # What the weightlift.dev/peers annotation hands this pod (None: nothing yet).
    handoff: PeerHandoff | None = None
    spare: bool = False  # a warm spare (the weightlift.dev/spare label): not serving, waiting
    serving_labelled: bool = False  # carries the weightlift.dev/serving label (its Service's)
    # Its weightlift.dev/inference-probe readiness gate condition: True or False (absent is
    # False, as the kubelet reads it); None for a pod without the gate (made by an older version).
    probe_gate: bool | None = None
    container_restarts: int = 0  # its container restarted in place (a group's pods only)
    # The pod template revision it was made from (its weightlift.dev/pod-template label); None
    # for a pod an older version made, which is adopted as current (Plan.adopt).
    template: str | None = None
    # A multi-pod replica (a LeaderWorkerSet group) is observed as its leader, the fields above
    # summing up the group (groups.py); `members` are all its pods, leader first.
    members: tuple[ObservedPod, ...] = ()

    @property
    def failed(self) -> bool:
        worker_failed = self.worker is not None and self.worker.phase == WorkerPhase.FAILED
        # A terminated container (`failure`) of a Running pod: a group's pod between its exit
        # and its restart in place.
        ended = self.failure is not None or self.container_restarts > 0
        return self.phase in ("Failed", "Succeeded") or worker_failed or ended

    @property
    def permanent_failure(self) -> bool:
        return self.failed and self.worker is not None and self.worker.permanent_failure

    @property
    def inference_ready(self) -> bool:
        return (
            not self.spare
            and not self.terminating
            and not self.failed
            and self.pod_ready
            and self.probe is not None
            and self.probe.passed
        )

    @property
    def loading(self) -> bool:
        return not self.terminating and not self.failed and not self.pod_ready

    @property
    def waiting_for_peers(self) -> bool:
        """A Target created before any source was Ready, still not handed peers or storage."""
        handed = self.handoff is not None and self.handoff.given
        return self.role == Role.TARGET and self.loading and not handed

    @property
    def in_standby(self) -> bool:
        """The worker says it is ready for its weights and waits for them."""
        return self.loading and self.worker is not None and self.worker.phase == WorkerPhase.STANDBY

    @property
    def failure_message(self) -> str:
        restarted = self.container_restarts and self.failure
        worker_failed = self.worker is not None and self.worker.phase == WorkerPhase.FAILED
        if restarted and not worker_failed:
            return str(self.failure)  # its last run's end, not what the new run says so far
        if self.worker is not None and self.worker.message:
            return self.worker.message
        return self.failure or f"pod phase {self.phase}"


@dataclass(frozen=True)
class Observed:
    name: str
    namespace: str
    generation: int
    now: datetime
    pods: list[ObservedPod] = field(default_factory=list)
    # Ready sources published by other ModelDeployments of the namespace (any identity).
    sibling_sources: list[SourceEndpoint] = field(default_factory=list)
    previous: ModelDeploymentStatus | None = None
    # Most GPUs any schedulable node offers; None when unknown (no node list permission).
    max_node_gpus: int | None = None
    # Directories hostpath:// and file:// model URIs may name (the operator's
    # --model-path-prefix, the chart's modelPathPrefixes); empty: none.
    model_path_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecError:
    """A spec the pydantic model rejected (observe parses, plan decides what it means)."""

    message: str  # names the field: "spec.replicas: Input should be a valid integer"


@dataclass(frozen=True)
class DesiredPod:
    name: str
    replica: int
    role: Role
    identity: str
    peers: list[SourceEndpoint]
    spare: bool = False  # a warm spare: a Target that waits in Standby until a scale-up


# The phases that get an Event: outcomes and a wait the user may act on. Progress (Pending,
# Loading, Probing) is in status.conditions with its transition time, and an Event for each
# step was two API writes of a deployment's ~17 (issue 34: the ramp's requests).
EVENT_PHASES = frozenset({Phase.READY, Phase.DEGRADED, Phase.FAILED, Phase.WAITING_FOR_SOURCE})


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    create: list[DesiredPod] = field(default_factory=list)
    delete: dict[str, str] = field(default_factory=dict)  # pod -> reason
    relabel: dict[str, Role] = field(default_factory=dict)  # pod -> new role
    # pod -> what its weightlift.dev/peers annotation hands it (peers or storage)
    handoff: dict[str, PeerHandoff] = field(default_factory=dict)
    # pod -> why a storage hand-off replaces its pull: wait_expired | sources_gone (metrics)
    fallbacks: dict[str, str] = field(default_factory=dict)
    # Warm spares a scale-up turns into serving replicas: their spare label comes off.
    unspare: set[str] = field(default_factory=set)
    # Pods that get the weightlift.dev/serving label (their Service selects them): serving
    # replicas, handed their weights, that do not carry it yet.
    serve: set[str] = field(default_factory=set)
    # pod -> the status its inference-probe gate condition turns to (True: probed; False: it
    # stopped passing), only where that differs from what the pod shows.
    gates: dict[str, bool] = field(default_factory=dict)
    # pod -> the pod template revision its label gets: current pods an older version made.
    adopt: dict[str, str] = field(default_factory=dict)
    status: ModelDeploymentStatus = field(default_factory=ModelDeploymentStatus)
    events: list[Event] = field(default_factory=list)
    requeue_after: float = POLL_STEADY


# Why planning deletes a replica of an older revision, followed by what changed: "model
# identity" or "pod template" (groups.py deletes such a group's whole set).
SUPERSEDED = "superseded by a new"
ROLLED_OVER = "rolled over to the new"


@dataclass(frozen=True)
class Revision:
    """What the current replicas are: their model identity (the bytes each rank holds) and
    their pod template revision (what the pod is made of)."""

    identity: str
    template: str

    @classmethod
    def of(cls, spec: ModelDeploymentSpec) -> Revision:
        return cls(model_identity(spec), pod_template_revision(spec))

    def current(self, pod: ObservedPod) -> bool:
        """Made from this revision (a pod without the template label is adopted)."""
        return pod.identity == self.identity and pod.template in (None, self.template)


def host_port(ip: str, port: int) -> str:
    """host:port, with brackets around IPv6 addresses."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def pod_name(deployment: str, identity: str, replica: int) -> str:
    return f"{deployment}-{identity[:6]}-{replica}"


def _aware(moment: datetime) -> datetime:
    """Observed.now without a zone is taken as UTC (comparing naive and aware would raise)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _validate_storage(spec: ModelDeploymentSpec, uri: ModelUri) -> str | None:
    model = spec.model
    if uri.scheme == "s3" and not uri.claim:
        return "spec.model.uri: s3:// needs a bucket, e.g. s3://models/llama-3"
    if uri.scheme == "hf":
        repo_id, revision = hf_repo(uri, model.revision)
        if not repo_id or "@" in repo_id:
            return "spec.model.uri: hf:// needs a repo id, e.g. hf://org/name or hf://org/name@rev"
        pinned = revision != model.revision
        if pinned and model.revision != DEFAULT_REVISION:
            return (
                f"spec.model.revision: {model.revision!r} disagrees with the revision in "
                f"spec.model.uri ({revision!r}); set one of them"
            )
    if uri.scheme not in REMOTE_SCHEMES:
        for field in ("credentials", "endpoint", "region"):
            if getattr(model, field) is not None:
                return f"spec.model.{field}: only s3:// and hf:// models use it"
    if uri.scheme == "hf" and model.region is not None:
        return "spec.model.region: only s3:// models use it"
    return None


def validate(spec: ModelDeploymentSpec, observed: Observed) -> str | None:
    """Semantic checks the CRD schema cannot express; returns a message naming the field."""
    if len(observed.name) > MAX_NAME_LENGTH:
        return (
            f"metadata.name: {len(observed.name)} characters; at most {MAX_NAME_LENGTH} "
            "(worker pod names and labels derive from it)"
        )
    uri = ModelUri.parse(spec.model.uri)
    scheme = uri.scheme
    if scheme not in SUPPORTED_STORAGE:
        return (
            f"spec.model.uri: scheme {scheme}:// needs a storage downloader this version does "
            f"not ship; use one of {', '.join(s + '://' for s in SUPPORTED_STORAGE)}"
        )
    if is_local_path(scheme) and not path_allowed(uri.path, observed.model_path_prefixes):
        allowed = ", ".join(observed.model_path_prefixes) or "none are"
        return (
            f"spec.model.uri: {uri.path} is not below a directory the cluster admin allows for "
            f"{scheme}:// ({allowed}; chart value modelPathPrefixes)"
        )
    if scheme == "pvc" and not (uri.claim and uri.path):
        return "spec.model.uri: pvc:// needs a claim and a path, e.g. pvc://models/llama-3"
    problem = _validate_storage(spec, uri)
    if problem:
        return problem
    par = spec.parallelism
    gpus = par.ranks_per_pod
    if observed.max_node_gpus is not None and gpus > observed.max_node_gpus:
        field_name = "tensor" if par.pods_per_replica == 1 else "podsPerReplica"
        return (
            f"spec.parallelism.{field_name}: {gpus} GPUs per pod but the largest node offers "
            f"{observed.max_node_gpus} {spec.template.gpu_resource}"
        )
    problem = _validate_groups(spec)
    if problem:
        return problem
    hooks = spec.init_hooks
    escapes = hooks is not None and (
        hooks.library.startswith("/") or ".." in hooks.library.split("/")
    )
    if hooks is not None and escapes and not hooks.allow_outside_model_dir:
        return (
            f"spec.initHooks.library: {hooks.library!r} is outside the model dir; use a "
            "path relative to it or set spec.initHooks.allowOutsideModelDir"
        )
    request = spec.probe.request if spec.probe is not None else None
    if request is not None and not (isinstance(request.get("inputs"), list) and request["inputs"]):
        return "spec.probe.request: a KServe v2 request needs a non-empty 'inputs' list"
    return None


# What a multi-pod replica can run: the builtin runtime's group (engines/builtin/group.py) and
# vLLM's own multi-node executor (engines/vllm/group.py). Triton's vLLM runs inside one server.
GROUP_ENGINES = (Engine.BUILTIN, Engine.VLLM)


def _validate_groups(spec: ModelDeploymentSpec) -> str | None:
    """What multi-pod replicas (LeaderWorkerSet groups) run today: tensor ranks spread over the
    pods of the builtin runtime or of vLLM (one vLLM node per pod); refused rather than run
    under another identity."""
    par = spec.parallelism
    if par.pipeline > 1:
        return (
            f"spec.parallelism.pipeline: {par.pipeline}; this operator version runs one pipeline "
            "stage per replica (tensor ranks may span pods: podsPerReplica)"
        )
    if par.pods_per_replica == 1:
        return None
    rt = spec.runtime
    if rt.type != RuntimeType.BUILTIN or rt.engine not in GROUP_ENGINES:
        return (
            f"spec.parallelism.podsPerReplica: {par.pods_per_replica}; multi-pod replicas run "
            "runtime.engine Builtin or vLLM in this version"
        )
    if spec.warm_spares:
        return f"spec.warmSpares: {spec.warm_spares}; {GROUP_SPARES_MESSAGE}"
    return None


@dataclass
class _Failures:
    restarts: int  # replacements since the deployment was last Ready (the backoff's count)
    group_restarts: dict[str, int]  # group -> recreations in a row
    backing_off: list[tuple[ObservedPod, float]] = field(default_factory=list)
    given_up: list[ObservedPod] = field(default_factory=list)  # groups left Failed


def _replace_failed(
    spec: ModelDeploymentSpec,
    observed: Observed,
    identity: str,
    current: list[ObservedPod],
    result: Plan,
) -> _Failures:
    """Transient failures are replaced after an exponential backoff (like CrashLoopBackOff);
    permanent ones (bad files, missing init symbol) stay so the status and the pod keep saying
    why, until the spec changes; a group recreated maxGroupRestarts times in a row is given up."""
    out = _Failures(
        restarts=observed.previous.restarts if observed.previous else 0,
        group_restarts=_group_restarts(observed, identity, current),
    )
    for pod in current:
        recreated = out.group_restarts.get(pod.name, 0)
        spent = pod.members and recreated >= spec.parallelism.max_group_restarts
        if spent and not pod.inference_ready and _given_up_before(observed, pod.name):
            # Given up stays given up until it is Ready or the spec changes: a pass that sees
            # none of its pods failed (a rank between its exit and the kubelet noticing it, its
            # report unreadable) must not turn the phase back to Loading.
            out.given_up.append(pod)
            continue
        if not pod.failed or pod.permanent_failure:
            continue
        if spent:
            out.given_up.append(pod)
            continue
        left = _backoff_left(pod, out.restarts, observed.now)
        if left > 0:
            out.backing_off.append((pod, left))
            continue
        result.delete[pod.name] = f"replacing failed replica: {pod.failure_message}"
        out.restarts += 1
        if pod.members:
            out.group_restarts[pod.name] = recreated + 1
        result.events.append(
            Event(
                "Warning",
                "ReplicaRestarted",
                f"{pod.name} failed ({pod.failure_message}); replacement {out.restarts}",
            )
        )
    return out


def plan(spec: ModelDeploymentSpec | SpecError, observed: Observed) -> Plan:
    if observed.now.tzinfo is None:
        observed = replace(observed, now=_aware(observed.now))
    if isinstance(spec, SpecError):
        return _unparsable(spec, observed)
    revision = Revision.of(spec)
    identity = revision.identity
    result = Plan()
    live = [p for p in observed.pods if not p.terminating]

    problem = validate(spec, observed)
    if problem is not None:
        # Lose nothing: existing replicas keep serving (and feeding others) until the spec is
        # fixed, and a wait for a source keeps its start time.
        current = [p for p in live if revision.current(p)]
        sources = _ready_sources(spec, observed, identity, current)
        result.status = _status(spec, observed, revision, live, sources, Phase.FAILED, problem)
        result.status.waiting_since = observed.previous.waiting_since if observed.previous else None
        result.status.conditions = _conditions(
            spec, observed, current, result.status, "InvalidSpec"
        )
        result.events.extend(_invalid_spec_event(observed, problem))
        _serving(live, result)
        return result

    current = [p for p in live if revision.current(p)]
    old = [p for p in live if not revision.current(p)]
    # An older pod template's Ready replicas hold the same bytes: new pods pull from them.
    same_bytes = [p for p in old if p.identity == identity]

    failures = _replace_failed(spec, observed, identity, current, result)
    restarts, group_restarts = failures.restarts, failures.group_restarts
    backing_off, given_up = failures.backing_off, failures.given_up
    current = [p for p in current if p.name not in result.delete]
    # Warm spares stand apart: sources, scaling, hand-offs and the phase count serving replicas
    # only, until a scale-up wakes a spare.
    spares = [p for p in current if p.spare]
    current = [p for p in current if not p.spare]

    sources = _ready_sources(spec, observed, identity, [*current, *same_bytes])
    _scale_down(spec, current, spares, sources, result)
    current = [p for p in current if p.name not in result.delete]
    _promote(current, result)
    _roll_over(spec, identity, current, old, result)
    # A replica being scaled down or rolled over is no candidate for anyone any more.
    sources = [s for s in sources if s.pod not in result.delete]
    wait_expired = _wait_expired(spec, observed)
    woken = _wake_spares(spec, current, old, spares, sources, wait_expired, result)
    current = [*current, *woken]
    spares = [p for p in spares if p.name not in result.unspare]
    _scale_up(spec, observed, identity, current, old, sources, wait_expired, result)
    _keep_spares(spec, observed, identity, current, spares, result)
    waiting = _hand_off(spec, observed, current, sources, wait_expired, result)
    # The status shows the woken spares as what they now are.
    by_name = {p.name: p for p in woken}
    live = [by_name.get(p.name, p) for p in live]

    _serving(live, result)
    _adopt(revision, [*current, *spares], result)
    phase, message = _phase(spec, current, old, waiting, result)
    message = _rolling(message, identity, old, result)
    if given_up and phase != Phase.FAILED:
        pod = given_up[0]
        phase = Phase.FAILED
        message = (
            f"{given_up_prefix(pod.name)}{group_restarts.get(pod.name, 0) + 1} times in a row "
            f"(spec.parallelism.maxGroupRestarts {spec.parallelism.max_group_restarts}), "
            f"not recreated until the spec changes: {pod.failure_message}"
        )
        if not pod.failed and observed.previous is not None:
            message = observed.previous.message  # why it was given up, not a blank reason
    elif backing_off and phase != Phase.FAILED:
        pod, left = backing_off[0]
        phase = Phase.DEGRADED if any(p.inference_ready for p in current) else Phase.PENDING
        message = f"{pod.name} failed ({pod.failure_message}); replacing it in {left:.0f}s"
    result.status = _status(spec, observed, revision, live, sources, phase, message)
    # The backoff starts over once the whole deployment is Ready again.
    result.status.restarts = 0 if phase == Phase.READY else restarts
    result.status.group_restarts = group_restarts or None
    result.status.waiting_since = _waiting_since(observed, waiting)
    result.status.conditions = _conditions(spec, observed, current, result.status, None)
    previous_phase = observed.previous.phase if observed.previous else None
    if previous_phase != phase and phase in EVENT_PHASES:
        kind = "Warning" if phase in (Phase.FAILED, Phase.DEGRADED) else "Normal"
        result.events.append(Event(kind, f"Phase{phase}", message or f"phase is {phase}"))
    in_motion = [
        p
        for p in current
        if not p.permanent_failure and not p.inference_ready and p not in given_up
    ]
    # A spare is in motion until it is warm (its status says when it is).
    in_motion += [p for p in spares if p.loading and not p.in_standby]
    busy = waiting or in_motion or old or result.create or result.delete
    result.requeue_after = _poll(spec, in_motion, bool(waiting)) if busy else _steady_poll(spec)
    for _, left in backing_off:
        result.requeue_after = max(0.5, min(result.requeue_after, left))
    if waiting and _was_waiting(observed):
        # Wake up when the wait runs out, but never spin: at least a short pause.
        result.requeue_after = max(0.5, min(result.requeue_after, _wait_left(spec, observed)))
    return result


def _adopt(revision: Revision, pods: list[ObservedPod], result: Plan) -> None:
    """Label the current pods an older version made (none that this plan deletes)."""
    unlabelled = [p for p in pods if p.template is None and p.name not in result.delete]
    result.adopt = {p.name: revision.template for p in unlabelled}


def _serving(live: list[ObservedPod], result: Plan) -> None:
    """The Service's label and the readiness gate. A replica joins its Service (the label) once
    handed its weights, storage or peers, not while it waits for a source nor as a warm spare;
    an older revision's replica stays in it until the rollover retires (deletes) it, so a
    rollout never empties the Service. Its endpoint turns ready when the gate does: True once
    its inference probe passed, False when it stops passing. Pods being deleted get neither.
    A group (a multi-pod replica) is decided as one replica, by its name: groups.py gives the
    label and the gate to its leader pod only, the one that answers the API."""
    for pod in live:
        if pod.name in result.delete:
            continue
        handed = pod.name in result.handoff or (pod.handoff is not None and pod.handoff.given)
        if handed and not pod.spare and not pod.serving_labelled:  # woken spares: spare=False
            result.serve.add(pod.name)
        if pod.probe_gate is not None and pod.probe_gate != pod.inference_ready:
            result.gates[pod.name] = pod.inference_ready


def _invalid_spec_event(observed: Observed, problem: str) -> list[Event]:
    previous = observed.previous
    if previous is not None and previous.phase == Phase.FAILED and previous.message == problem:
        return []  # the same problem as last pass: it has had its Event
    return [Event("Warning", "InvalidSpec", problem)]


def _unparsable(error: SpecError, observed: Observed) -> Plan:
    """Failed/InvalidSpec naming the field. Without a spec there is nothing to compute:
    replicas, sources and progress stay as they were (the running pods keep serving until
    the spec is fixed); no pod is created, deleted or relabelled."""
    base = observed.previous or ModelDeploymentStatus()
    before = next((c for c in base.conditions if c.type == ConditionType.READY), None)
    same = (
        before is not None
        and before.status == "False"
        and before.reason == "InvalidSpec"
        and before.message == error.message
        and before.last_transition_time
    )
    ready = Condition(
        type=ConditionType.READY,
        status="False",
        reason="InvalidSpec",
        message=error.message,
        last_transition_time=before.last_transition_time
        if same and before is not None
        else rfc3339(observed.now),
    )
    kept = [c for c in base.conditions if c.type != ConditionType.READY]
    status = base.model_copy(
        update={
            "phase": Phase.FAILED,
            "message": error.message,
            "observed_generation": observed.generation,
            "conditions": [*kept, ready],
        }
    )
    # Nothing moves until the spec changes, and a spec change wakes the loop.
    return Plan(
        status=status,
        events=_invalid_spec_event(observed, error.message),
        requeue_after=POLL_STEADY,
    )


def _given_up_before(observed: Observed, group: str) -> bool:
    previous = observed.previous
    return (
        previous is not None
        and previous.phase == Phase.FAILED
        and (previous.message or "").startswith(given_up_prefix(group))
    )


def given_up_prefix(group: str) -> str:
    return f"{group} failed "


def _group_restarts(
    observed: Observed, identity: str, current: list[ObservedPod]
) -> dict[str, int]:
    """Each group's recreations in a row (by leader name, which LWS keeps), carried in the
    status so an operator restart keeps them: a group Ready now starts over, and so does every
    group once the spec changes. A group being recreated (not observed now) keeps its count."""
    previous = observed.previous
    if previous is None or previous.observed_generation != observed.generation:
        return {}
    ready = {p.name for p in current if p.inference_ready}
    prefix = pod_name(observed.name, identity, 0)[:-1]
    return {
        name: count
        for name, count in (previous.group_restarts or {}).items()
        if name.startswith(prefix) and name not in ready and count > 0
    }


def backoff_seconds(restarts: int) -> float:
    """Wait before the next replacement after `restarts` of them: 0, 10, 20, 40 .. 300 s."""
    return 0.0 if restarts == 0 else min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (restarts - 1))


def _backoff_left(pod: ObservedPod, restarts: int, now: datetime) -> float:
    if pod.failed_at is None:
        return 0.0
    return backoff_seconds(restarts) - (now - pod.failed_at).total_seconds()


def _poll(spec: ModelDeploymentSpec, in_motion: list[ObservedPod], waiting: bool) -> float:
    """While something moves: often when only polling shows it (a running worker's loading
    progress and probe; a wait for a source that is not one of our own pods coming up), else
    the pending poll (pod events wake the loop)."""
    running = any(p.phase == "Running" and not p.terminating for p in in_motion)
    own_source_coming = any(p.role == Role.SOURCE and not p.failed for p in in_motion)
    if running or (waiting and not own_source_coming):
        return POLL_WHILE_LOADING
    return min(POLL_PENDING, _steady_poll(spec))


def _steady_poll(spec: ModelDeploymentSpec) -> float:
    return float(spec.probe.period_seconds) if spec.probe else POLL_STEADY


def _ready_sources(
    spec: ModelDeploymentSpec, observed: Observed, identity: str, current: list[ObservedPod]
) -> list[SourceEndpoint]:
    """Replicas that passed inference probes hold verified weights: they can feed others."""
    ranks = list(range(spec.parallelism.tensor))
    own = [
        SourceEndpoint(
            pod=p.name,
            deployment=observed.name,
            address=host_port(p.pod_ip, spec.runtime.port),
            model_identity=identity,
            ranks=ranks,
        )
        for p in sorted(current, key=lambda p: p.replica)
        if p.inference_ready and p.pod_ip
    ]
    if spec.parallelism.pods_per_replica > 1:
        # A group pulls rank-matched from the pods of a source group, which only this
        # deployment's own groups are known by (published sources name a leader only).
        return own
    siblings = [
        s
        for s in observed.sibling_sources
        if s.model_identity == identity and s.deployment != observed.name
    ]
    return own + siblings


def _scale_down(
    spec: ModelDeploymentSpec,
    current: list[ObservedPod],
    spares: list[ObservedPod],
    sources: list[SourceEndpoint],
    result: Plan,
) -> None:
    excess = len(current) - spec.replicas
    if excess <= 0:
        return
    # Cheapest first: not-ready before ready, targets before sources, waiting for peers before
    # loading, highest index first.
    victims = sorted(
        current,
        key=lambda p: (
            p.inference_ready,
            p.role == Role.SOURCE,
            not p.waiting_for_peers,
            -p.replica,
        ),
    )
    remaining_sources = {s.pod for s in sources}
    # A spare is kept through any scale-down: the last source waits for one pulling from peers,
    # not for one not handed anything yet (it may never start; it will be handed storage).
    spare_pulling = any(p.loading and p.handoff is not None and p.handoff.peers for p in spares)
    for pod in victims:
        if excess == 0:
            break
        survivors = [p for p in current if p.name != pod.name and p.name not in result.delete]
        someone_loading = spare_pulling or any(p.loading for p in survivors)
        if pod.name in remaining_sources and remaining_sources == {pod.name} and someone_loading:
            result.events.append(
                Event(
                    "Normal",
                    "ScaleDownDeferred",
                    f"keeping {pod.name}: last source while a target is still loading",
                )
            )
            continue
        result.delete[pod.name] = "scaled down"
        remaining_sources.discard(pod.name)
        excess -= 1


def _promote(current: list[ObservedPod], result: Plan) -> None:
    """If no Source-role replica is left, a loaded target takes the role."""
    if any(p.role == Role.SOURCE and not p.failed for p in current):
        return
    loaded = sorted((p for p in current if p.inference_ready), key=lambda p: p.replica)
    if loaded:
        chosen = loaded[0]
        result.relabel[chosen.name] = Role.SOURCE
        result.events.append(
            Event("Normal", "Promoted", f"{chosen.name} promoted to source: no source was left")
        )


def _roll_over(
    spec: ModelDeploymentSpec,
    identity: str,
    current: list[ObservedPod],
    old: list[ObservedPod],
    result: Plan,
) -> None:
    """Retire replicas of a previous revision (identity or pod template) without dropping
    below the ready count."""
    if not old:
        return
    for pod in old:
        if not pod.inference_ready:
            result.delete[pod.name] = f"{SUPERSEDED} {_changed(pod, identity)}"
    ready_old = sorted(
        (p for p in old if p.inference_ready),
        key=lambda p: (p.role == Role.SOURCE, -p.replica),
    )
    ready_new = sum(p.inference_ready for p in current)
    retire = max(0, ready_new + len(ready_old) - spec.replicas)
    if ready_new >= spec.replicas:
        retire = len(ready_old)
    for pod in ready_old[:retire]:
        result.delete[pod.name] = f"{ROLLED_OVER} {_changed(pod, identity)}"


def _changed(old: ObservedPod, identity: str) -> str:
    return "pod template" if old.identity == identity else "model identity"


def _rolling(message: str, identity: str, old: list[ObservedPod], result: Plan) -> str:
    """The phase's message, saying what a rollover still waits for."""
    left = [p for p in old if p.name not in result.delete]
    if not left:
        return message
    changed = _changed(left[0], identity)
    return f"{message}; rolling over to the new {changed}: {len(left)} older replica(s) left"


def _wait_expired(spec: ModelDeploymentSpec, observed: Observed) -> bool:
    if spec.loading.wait_for_source_seconds == 0:
        return True
    return _was_waiting(observed) and _wait_left(spec, observed) <= 0


def _peer_list(sources: list[SourceEndpoint]) -> list[PeerCandidate]:
    return [PeerCandidate(pod=s.pod, address=s.address) for s in sources]


def _scale_up(
    spec: ModelDeploymentSpec,
    observed: Observed,
    identity: str,
    current: list[ObservedPod],
    old: list[ObservedPod],
    sources: list[SourceEndpoint],
    wait_expired: bool,
    result: Plan,
) -> None:
    """Create every missing replica at once: the first initialSources load from storage; the
    others are Targets, handed the Ready sources when there are any, else started in standby
    (no peers yet: `_hand_off` gives them peers or storage later)."""
    need = _missing(spec, current, old, result)
    if need <= 0:
        return
    free = _free_replicas(observed, identity, result)
    # The operator decides role and peers only; the worker picks its loader. Whether a Target
    # can pull at all is the contract's one rule, which the worker follows too.
    storage_only = not pulls_from_peers(spec.loading, spec.runtime)
    storage_loaders = _storage_loaders(current, sources)
    peers: list[SourceEndpoint]
    for _ in range(need):
        if spec.parallelism.pods_per_replica > 1:
            # One LeaderWorkerSet template serves every group: each starts waiting, and
            # `_hand_off` gives it its role (storage or peers) once its pods exist.
            role, peers = Role.TARGET, []
        elif storage_only or (wait_expired and not sources):
            role, peers = Role.SOURCE, []
        elif sources:
            role, peers = Role.TARGET, list(sources)
        elif storage_loaders < spec.loading.initial_sources:
            role, peers = Role.SOURCE, []
            storage_loaders += 1
        else:
            role, peers = Role.TARGET, []  # standby until a source is Ready
        replica = next(free)
        result.create.append(
            DesiredPod(pod_name(observed.name, identity, replica), replica, role, identity, peers)
        )


def _missing(
    spec: ModelDeploymentSpec, current: list[ObservedPod], old: list[ObservedPod], result: Plan
) -> int:
    """Serving replicas to add now: up to spec.replicas, within maxSurge while older replicas
    are left."""
    need = spec.replicas - len(current)
    old_left = [p for p in old if p.name not in result.delete]
    if old_left:
        need = min(need, spec.replicas + spec.rollout.max_surge - len(current) - len(old_left))
    return max(0, need)


def _free_replicas(observed: Observed, identity: str, result: Plan) -> Iterator[int]:
    """Lowest free indices whose pod name exists nowhere (terminating pods and this plan's
    creations included; names carry only a prefix of the identity, so check names too)."""
    taken_names = {p.name for p in observed.pods} | {d.name for d in result.create}
    taken = {p.replica for p in observed.pods if p.identity == identity}
    return (
        i
        for i in range(10**6)
        if i not in taken and pod_name(observed.name, identity, i) not in taken_names
    )


def _storage_loaders(current: list[ObservedPod], sources: list[SourceEndpoint]) -> int:
    """Source-role replicas on their way to Ready (scheduling, loading, or loaded and waiting
    for the inference probe): they count against initialSources."""
    source_pods = {s.pod for s in sources}
    return sum(
        p.role == Role.SOURCE and not p.failed and p.name not in source_pods for p in current
    )


def _wake_spares(
    spec: ModelDeploymentSpec,
    current: list[ObservedPod],
    old: list[ObservedPod],
    spares: list[ObservedPod],
    sources: list[SourceEndpoint],
    wait_expired: bool,
    result: Plan,
) -> list[ObservedPod]:
    """A scale-up (from zero too) is served by spares first: the same pod, its engine started,
    gets the Ready sources as peers, or storage (as a Source) while no source is Ready and
    fewer than initialSources replicas load from storage; else it waits for a source as any
    standby Target does (`_hand_off`). Warm spares go first, then scheduled ones, lowest index
    first (the same choice on every pass). Returns the woken spares as serving replicas."""
    need = _missing(spec, current, old, result)
    candidates = sorted(
        (p for p in spares if p.loading),
        key=lambda p: (not p.in_standby, p.node is None, p.replica),
    )
    if need <= 0 or not candidates:
        return []
    storage_only = not pulls_from_peers(spec.loading, spec.runtime)
    loaders = _storage_loaders(current, sources)
    woken: list[ObservedPod] = []
    for pod in candidates[:need]:
        result.unspare.add(pod.name)
        role, handoff = pod.role, None
        if sources and not storage_only:
            handoff = PeerHandoff(peers=_peer_list(sources))
        elif storage_only or wait_expired or loaders < spec.loading.initial_sources:
            role, handoff = Role.SOURCE, PeerHandoff(storage=True)
            result.relabel[pod.name] = Role.SOURCE
            loaders += 1
        if handoff is not None:
            result.handoff[pod.name] = handoff
        woken.append(replace(pod, spare=False, role=role, handoff=handoff or pod.handoff))
    names = ", ".join(p.name for p in woken)
    result.events.append(
        Event("Normal", "SpareWoken", f"{names}: warm spare(s) now serving replicas")
    )
    return woken


def _keep_spares(
    spec: ModelDeploymentSpec,
    observed: Observed,
    identity: str,
    current: list[ObservedPod],
    spares: list[ObservedPod],
    result: Plan,
) -> None:
    """Keep spec.warmSpares spares of the current identity. A surplus goes (failed first, then
    the coldest, highest index first); serving replicas are never touched for it. New spares
    are Targets without peers (they wait in Standby), created only once every serving replica
    has its node: a spare never takes the GPU a serving replica waits for."""
    want = spec.warm_spares if pulls_from_peers(spec.loading, spec.runtime) else 0
    surplus = len(spares) - want
    if surplus > 0:
        victims = sorted(
            spares, key=lambda p: (not p.failed, p.in_standby, p.node is not None, -p.replica)
        )
        for pod in victims[:surplus]:
            result.delete[pod.name] = "warm spare no longer wanted"
        return
    creating = any(not d.spare for d in result.create)
    if surplus == 0 or creating or any(p.node is None for p in current):
        return
    free = _free_replicas(observed, identity, result)
    for _ in range(-surplus):
        replica = next(free)
        name = pod_name(observed.name, identity, replica)
        result.create.append(DesiredPod(name, replica, Role.TARGET, identity, [], spare=True))


def _hand_off(
    spec: ModelDeploymentSpec,
    observed: Observed,
    current: list[ObservedPod],
    sources: list[SourceEndpoint],
    wait_expired: bool,
    result: Plan,
) -> int:
    """Hand Targets in standby their peers (the Ready sources) through the pod annotation the
    kubelet projects into their hand-off file; when the wait for a source runs out, storage
    (and the Source role). A Target handed peers that are all gone while it still waits gets
    the sources there are now, or storage. Returns how many replicas still wait for a source
    (created ones included)."""
    if not pulls_from_peers(spec.loading, spec.runtime):
        return 0  # such a Target's worker loads from storage without waiting (strategy.py)
    kept = [p for p in current if p.name not in result.delete]
    offer = PeerHandoff(peers=_peer_list(sources)) if sources else None
    expired = 0
    # Groups were created waiting (`_scale_up`): the first initialSources of them load from
    # storage as soon as they exist, lowest index first, as single-pod Sources are created.
    loaders = _storage_loaders(current, sources)
    kept = sorted(kept, key=lambda p: p.replica)
    live = {s.pod for s in sources}
    for pod in kept:
        if pod.role != Role.TARGET or not pod.loading:
            continue
        handed = pod.handoff
        stale = (
            handed is not None
            and handed.peers
            and pod.in_standby
            and not any(c.pod in live for c in handed.peers)
        )
        if not pod.waiting_for_peers and not stale:
            continue
        if offer is not None:
            result.handoff[pod.name] = offer
        elif pod.members and not stale and loaders < spec.loading.initial_sources:
            result.handoff[pod.name] = PeerHandoff(storage=True)
            result.relabel[pod.name] = Role.SOURCE
            loaders += 1
        elif wait_expired or stale:
            result.handoff[pod.name] = PeerHandoff(storage=True)
            result.relabel[pod.name] = Role.SOURCE
            result.fallbacks[pod.name] = "sources_gone" if stale else "wait_expired"
            if stale:
                result.events.append(
                    Event(
                        "Normal",
                        "SourceGone",
                        f"{pod.name}: the sources it was handed are gone and no other is "
                        "Ready: loading from storage",
                    )
                )
            else:
                expired += 1
    if expired:
        result.events.append(
            Event(
                "Normal",
                "WaitForSourceExpired",
                f"no source became Ready within {spec.loading.wait_for_source_seconds}s: "
                f"{expired} replica(s) load from storage",
            )
        )
    still = [p for p in kept if p.waiting_for_peers and p.name not in result.handoff]
    created = [d for d in result.create if not d.spare]  # a spare waits for a scale-up
    return len(still) + sum(d.role == Role.TARGET and not d.peers for d in created)


def _was_waiting(observed: Observed) -> bool:
    return bool(observed.previous and observed.previous.waiting_since)


def _wait_left(spec: ModelDeploymentSpec, observed: Observed) -> float:
    assert observed.previous is not None and observed.previous.waiting_since is not None
    try:
        since = parse_rfc3339(observed.previous.waiting_since)
    except ValueError:  # someone edited the status: start the wait over rather than crash
        return float(spec.loading.wait_for_source_seconds)
    waited = (observed.now - since).total_seconds()
    return max(0.0, spec.loading.wait_for_source_seconds - waited)


def _waiting_since(observed: Observed, waiting: int) -> str | None:
    if not waiting:
        return None
    if _was_waiting(observed):
        assert observed.previous is not None and observed.previous.waiting_since is not None
        try:
            parse_rfc3339(observed.previous.waiting_since)
            return observed.previous.waiting_since
        except ValueError:
            pass
    return rfc3339(observed.now)


def _phase(
    spec: ModelDeploymentSpec,
    current: list[ObservedPod],
    old: list[ObservedPod],
    waiting: int,
    result: Plan,
) -> tuple[Phase, str]:
    kept = [p for p in current if p.name not in result.delete]
    broken = [p for p in kept if p.permanent_failure]
    if broken:
        pod = broken[0]
        return Phase.FAILED, f"{pod.name}: {pod.failure_message}"
    ready_new = sum(p.inference_ready for p in kept)
    old_left = [p for p in old if p.name not in result.delete]
    # Spares being created never hold the phase back: they are not replicas.
    creating = [d for d in result.create if not d.spare]
    if ready_new >= spec.replicas and not old_left and not creating:
        return Phase.READY, f"{ready_new}/{spec.replicas} replicas passed inference probes"
    unschedulable = [p for p in kept if p.unschedulable]
    if unschedulable:
        pod = unschedulable[0]
        return Phase.PENDING, f"{pod.name} unschedulable: {pod.unschedulable}"
    stuck = [p for p in kept if p.stuck]
    if stuck:
        return Phase.PENDING, f"{stuck[0].name}: {stuck[0].stuck}"
    if any(p.loading for p in kept) or creating:
        if not any(p.node for p in kept):
            return Phase.PENDING, "waiting for worker pods to be scheduled"
        if waiting:
            return Phase.LOADING, (
                f"replicas are loading weights; {waiting} replica(s) in standby wait for a Ready "
                "source"
            )
        return Phase.LOADING, "replicas are loading weights"
    if waiting:
        return Phase.WAITING_FOR_SOURCE, f"{waiting} replica(s) wait for a Ready source"
    failing = [p for p in kept if p.pod_ready and p.probe is not None and not p.probe.passed]
    if failing and ready_new > 0:
        pod = failing[0]
        return Phase.DEGRADED, f"{pod.name} fails inference probes: {pod.probe.message}"  # type: ignore[union-attr]
    if failing:
        pod = failing[0]
        return Phase.PROBING, f"{pod.name} fails inference probes: {pod.probe.message}"  # type: ignore[union-attr]
    if any(p.pod_ready and not p.inference_ready for p in kept):
        return Phase.PROBING, "weights loaded; waiting for inference probes"
    return Phase.PENDING, "creating replicas"


def _status(
    spec: ModelDeploymentSpec,
    observed: Observed,
    revision: Revision,
    live: list[ObservedPod],
    sources: list[SourceEndpoint],
    phase: Phase,
    message: str,
) -> ModelDeploymentStatus:
    identity = revision.identity
    ready = sum(p.inference_ready for p in live)
    updated = sum(p.inference_ready for p in live if revision.current(p))
    current = [p for p in live if revision.current(p) and not p.spare]
    warm = sum(p.spare and p.in_standby for p in live if revision.current(p))
    # Each replica of the desired count contributes its fraction of bytes on the device; one
    # that does not exist yet contributes nothing (all replicas of an identity load the same
    # bytes, so this is the percentage of bytes).
    fractions = [_loaded_fraction(p) for p in current]
    want = max(spec.replicas, len(current))
    loaded = round(100 * sum(fractions) / want) if want else 0
    own_sources = [s for s in sources if s.deployment == observed.name]
    return ModelDeploymentStatus(
        phase=phase,
        message=message,
        observed_generation=observed.generation,
        model_identity=identity,
        replicas=sum(not p.spare for p in live),
        ready_replicas=ready,
        updated_replicas=updated,
        ready=f"{ready}/{spec.replicas}",
        ready_sources=len(own_sources),
        standby=sum(p.in_standby for p in current),
        spares=warm,
        loaded=f"{min(loaded, 100)}%",
        # An HPA on the scale subresource counts (and reads metrics of) serving pods only.
        selector=f"{DEPLOYMENT_LABEL}={observed.name},!{SPARE_LABEL}",
        sources=own_sources,
        service=service_status(observed.name, spec),
        replica_statuses=[
            _replica_status(p)
            for p in sorted(live, key=lambda p: (not revision.current(p), p.replica))
        ],
    )


def _loaded_fraction(pod: ObservedPod) -> float:
    if pod.failed:
        return 0.0
    report = pod.worker
    if report is not None and report.bytes_total > 0:
        return min(1.0, report.bytes_loaded / report.bytes_total)
    return 1.0 if pod.pod_ready else 0.0


def _pod_phase(pod: ObservedPod) -> str:
    report = pod.worker
    if pod.failed:
        phase = "Failed"
    elif pod.inference_ready:
        phase = "Ready"
    elif pod.spare and pod.in_standby:
        phase = "Spare"
    elif report is not None and report.phase != WorkerPhase.STARTING:
        phase = report.phase
    elif pod.node:
        phase = "Scheduled"
    else:
        phase = "Pending"
    return phase


def _group_pod_status(pod: ObservedPod, index: int) -> GroupPodStatus:
    report = pod.worker
    phase = _pod_phase(pod)
    if phase == "Ready":
        phase = "Serving"  # Ready is the group's (its leader's probe), not one pod's
    return GroupPodStatus(
        name=pod.name,
        index=index,
        ranks=list(report.ranks) if report else [],
        phase=phase,
        pod_ip=pod.pod_ip,
        loaded_from=report.loaded_from if report else None,
        bytes_loaded=report.bytes_loaded if report else 0,
        bytes_total=report.bytes_total if report else 0,
        message=_pod_message(pod),
    )


def _pod_message(pod: ObservedPod) -> str:
    """What holds a replica back, in the words of whoever knows: the worker, the scheduler,
    the kubelet."""
    if pod.failed:
        return pod.failure_message
    return pod.unschedulable or pod.stuck or ""


def _transports(pod: ObservedPod) -> list[RankTransport] | None:
    """Every rank's P2P transport: a group's from each of its pods, else the pod's own."""
    reports = [m.worker for m in pod.members] if pod.members else [pod.worker]
    found = sorted((t for r in reports if r for t in r.transports), key=lambda t: t.rank)
    return found or None


def _replica_status(pod: ObservedPod) -> ReplicaStatus:
    report = pod.worker
    phase = _pod_phase(pod)
    message = _pod_message(pod)
    return ReplicaStatus(
        name=pod.name,
        replica=pod.replica,
        model_identity=pod.identity,
        role=pod.role,
        phase=phase,
        node=pod.node,
        pod_ip=pod.pod_ip,
        loaded_from=report.loaded_from if report else None,
        bytes_loaded=report.bytes_loaded if report else 0,
        bytes_total=report.bytes_total if report else 0,
        gbps=report.gbps if report else None,
        load_seconds=report.load_seconds if report else None,
        compile_cache=(report.compile_cache or None) if report else None,
        hooks_run=report.hooks_run if report else None,
        transports=_transports(pod),
        engine_ports=(report.engine_ports or None) if report else None,
        ready=pod.inference_ready,
        spare=pod.spare or None,
        probe=pod.probe,
        message=message,
        pods=[_group_pod_status(m, i) for i, m in enumerate(pod.members)] or None,
    )


def _conditions(
    spec: ModelDeploymentSpec,
    observed: Observed,
    current: list[ObservedPod],
    status: ModelDeploymentStatus,
    invalid_reason: str | None,
) -> list[Condition]:
    """Conditions over the replicas of the current identity, measured against spec.replicas:
    a replica that does not exist yet is neither scheduled nor loaded."""
    scheduled = [p for p in current if p.node]
    unschedulable = next((p for p in current if p.unschedulable), None)
    loaded = [p for p in current if p.pod_ready and not p.failed and not p.terminating]
    all_scheduled = len(scheduled) == len(current) and len(current) >= spec.replicas
    all_loaded = len(loaded) >= spec.replicas
    failing_probe = next(
        (p for p in current if p.pod_ready and p.probe and not p.probe.passed), None
    )
    if all_scheduled:
        scheduled_reason, scheduled_message = "AllScheduled", ""
    elif unschedulable is not None:
        scheduled_reason = "Unschedulable"
        scheduled_message = f"{unschedulable.name}: {unschedulable.unschedulable}"
    else:
        scheduled_reason = "Pending"
        scheduled_message = f"{len(scheduled)}/{spec.replicas} replicas scheduled"
    table: list[tuple[ConditionType, bool, str, str]] = [
        (ConditionType.SCHEDULED, all_scheduled, scheduled_reason, scheduled_message),
        (
            ConditionType.WEIGHTS_LOADED,
            all_loaded,
            "Loaded" if all_loaded else "Loading",
            f"{len(loaded)}/{spec.replicas} replicas loaded",
        ),
        (
            ConditionType.INFERENCE_READY,
            status.phase == Phase.READY,
            "ProbesPassed"
            if status.phase == Phase.READY
            else "ProbeFailed"
            if failing_probe
            else "Probing",
            failing_probe.probe.message if failing_probe and failing_probe.probe else "",
        ),
        (
            ConditionType.READY,
            status.phase == Phase.READY,
            invalid_reason or str(status.phase),
            status.message,
        ),
    ]
    previous = {c.type: c for c in (observed.previous.conditions if observed.previous else [])}
    now = rfc3339(observed.now)
    conditions = []
    for ctype, ok, reason, message in table:
        value = "True" if ok else "False"
        before = previous.get(ctype)
        kept = before is not None and before.status == value and before.last_transition_time
        since = before.last_transition_time if kept and before is not None else now
        conditions.append(
            Condition(
                type=ctype,
                status=value,
                reason=reason,
                message=message,
                last_transition_time=since,
            )
        )
    return conditions
