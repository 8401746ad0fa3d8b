"""Planning test support: spec and pod factories, the plan invariants, and a tiny cluster
simulator that applies each Plan, advances pods and re-plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from weightlift.api.model import (
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    ProbeResult,
    Role,
    SourceEndpoint,
)
from weightlift.api.worker import PeerCandidate, PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator import kube
from weightlift.operator.identity import model_identity, pod_template_revision
from weightlift.operator.planning import (
    Observed,
    ObservedPod,
    Plan,
    Revision,
    plan,
    pod_name,
)

NAME = "llm"
NAMESPACE = "models"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
PROBE_REQUEST: dict[str, Any] = {
    "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]
}


def make_spec(
    replicas: int = 1,
    *,
    uri: str = "pvc://models/llama-3",
    revision: str = "main",
    fmt: str = "pt2",
    dtype: str = "auto",
    tensor: int = 1,
    strategy: str = "Auto",
    initial_sources: int = 1,
    wait: int = 300,
    max_surge: int = 1,
    probe: dict[str, Any] | None = None,
    **extra: Any,
) -> ModelDeploymentSpec:
    body: dict[str, Any] = {
        "model": {"uri": uri, "revision": revision, "format": fmt, "dtype": dtype},
        "replicas": replicas,
        "parallelism": {"tensor": tensor},
        "loading": {
            "strategy": strategy,
            "initialSources": initial_sources,
            "waitForSourceSeconds": wait,
        },
        "rollout": {"maxSurge": max_surge},
        "probe": {"request": PROBE_REQUEST, "periodSeconds": 7} if probe is None else probe,
    }
    body.update(extra)
    return ModelDeploymentSpec.model_validate(body)


def ident(spec: ModelDeploymentSpec) -> str:
    return model_identity(spec)


def mkpod(
    spec_or_identity: ModelDeploymentSpec | str,
    replica: int,
    role: Role = Role.TARGET,
    *,
    state: str = "ready",
    deployment: str = NAME,
    **overrides: Any,
) -> ObservedPod:
    """A pod in one of the states: pending, scheduled, loading, loaded (probe not yet run),
    probe-failed, ready, failed (transient), broken (permanent failure), terminating."""
    identity = spec_or_identity if isinstance(spec_or_identity, str) else ident(spec_or_identity)
    fields: dict[str, Any] = {
        "name": pod_name(deployment, identity, replica),
        "replica": replica,
        "identity": identity,
        "role": role,
    }
    running = {"phase": "Running", "node": f"gpu-{replica}", "pod_ip": f"10.0.0.{replica + 10}"}
    if state == "pending":
        pass
    elif state == "scheduled":
        fields |= {"node": f"gpu-{replica}"}
    elif state == "loading":
        fields |= running | {"worker": WorkerReport(phase="Loading")}
    elif state == "loaded":
        fields |= running | {"pod_ready": True}
    elif state == "probe-failed":
        fields |= running | {
            "pod_ready": True,
            "probe": ProbeResult(passed=False, message="output y differs by 0.5"),
        }
    elif state == "ready":
        fields |= running | {
            "pod_ready": True,
            "probe": ProbeResult(passed=True, message="ok"),
            "worker": WorkerReport(phase="Serving", bytes_loaded=100, bytes_total=100),
        }
    elif state == "failed":
        fields |= running | {"phase": "Failed", "failure": "OOMKilled"}
    elif state == "broken":
        fields |= running | {
            "phase": "Failed",
            "worker": WorkerReport(
                phase="Failed",
                permanent_failure=True,
                message="libinit.so: undefined symbol triton_pytorch_model_init",
            ),
        }
    elif state == "terminating":
        fields |= running | {"terminating": True, "pod_ready": True}
    else:  # pragma: no cover - a typo in a test
        raise ValueError(state)
    fields |= overrides
    return ObservedPod(**fields)


def observe(
    pods: list[ObservedPod] | None = None,
    *,
    now: datetime = T0,
    previous: ModelDeploymentStatus | None = None,
    siblings: list[SourceEndpoint] | None = None,
    max_node_gpus: int | None = 8,
    generation: int = 3,
    model_path_prefixes: tuple[str, ...] = ("/models",),
) -> Observed:
    return Observed(
        name=NAME,
        namespace=NAMESPACE,
        generation=generation,
        now=now,
        pods=list(pods or []),
        sibling_sources=list(siblings or []),
        previous=previous,
        max_node_gpus=max_node_gpus,
        model_path_prefixes=model_path_prefixes,
    )


def sibling(
    identity: str, pod: str = "other-abc123-0", deployment: str = "other"
) -> SourceEndpoint:
    return SourceEndpoint(
        pod=pod, deployment=deployment, address="10.9.9.9:8000", model_identity=identity, ranks=[0]
    )


# ------------------------------------------------------------------------- plan invariants


def check_plan(observed: Observed, result: Plan, spec: ModelDeploymentSpec) -> None:
    """What every plan must satisfy, whatever the observed state."""
    existing = {p.name for p in observed.pods}
    created = [d.name for d in result.create]
    assert len(created) == len(set(created)), f"duplicate creates {created}"
    assert not set(created) & existing, f"creates existing pods {set(created) & existing}"
    assert set(result.delete) <= existing, f"deletes unknown pods {set(result.delete) - existing}"
    assert set(result.relabel) <= existing - set(result.delete), "relabels a missing pod"
    identity = ident(spec)
    revision = Revision.of(spec)
    for desired in result.create:
        assert desired.identity == identity
        assert desired.name == pod_name(NAME, identity, desired.replica)
        if desired.spare:
            assert desired.role == Role.TARGET and desired.peers == [], "a spare waits for peers"
        elif desired.role == Role.SOURCE:
            assert desired.peers == [], "a storage source gets no peers"
        elif desired.peers:
            assert all(p.model_identity == identity for p in desired.peers)
        else:  # standby: only while no source of the identity is Ready
            assert not result.status.sources, "a standby target while a source is Ready"
            assert not [
                s
                for s in observed.sibling_sources
                if s.model_identity == identity and s.deployment != NAME
            ]
    assert set(result.handoff) <= existing - set(result.delete), "hands off to a missing pod"
    for name, handoff in result.handoff.items():
        assert handoff.given, f"an empty hand-off to {name}"
        assert not (handoff.peers and handoff.storage), f"peers and storage to {name}"
    live_after = [p for p in observed.pods if not p.terminating and p.name not in result.delete]
    # Spares stand apart from replicas: the surge and the replica count are about serving pods.
    serving_after = [p for p in live_after if not p.spare or p.name in result.unspare]
    spares_after = [p for p in live_after if p.spare and p.name not in result.unspare]
    serving_created = [d for d in result.create if not d.spare]
    spares_created = [d for d in result.create if d.spare]
    if serving_created:
        total = len(serving_after) + len(serving_created)
        assert total <= spec.replicas + spec.rollout.max_surge, "surge exceeded"
        current_after = sum(map(revision.current, serving_after)) + len(serving_created)
        assert current_after <= spec.replicas, "created more than replicas of the revision"
    if spares_created:
        assert not serving_created, "spares created before the serving replicas they would crowd"
        current_spares = sum(map(revision.current, spares_after))
        assert current_spares + len(spares_created) <= spec.warm_spares, "more spares than wanted"
    spare_names = {p.name for p in observed.pods if p.spare and not p.terminating}
    assert result.unspare <= spare_names - set(result.delete), "wakes a pod that is no spare"
    woken = [p for p in observed.pods if p.name in result.unspare]
    assert all(map(revision.current, woken)), "wakes an old spare"
    # Only pods an older version made (no template label) are adopted, as the current revision.
    unlabelled = {p.name for p in observed.pods if p.template is None and revision.current(p)}
    assert set(result.adopt) <= unlabelled - set(result.delete), "adopts a labelled or gone pod"
    assert set(result.adopt.values()) <= {revision.template}
    assert result.status.replicas == sum(
        not p.spare or p.name in result.unspare for p in observed.pods if not p.terminating
    ), "status.replicas counts serving pods only"
    # Sources published in the status are Ready pods of this deployment that survive the plan.
    by_name = {p.name: p for p in observed.pods}
    for source in result.status.sources:
        pod = by_name[source.pod]
        assert pod.inference_ready and source.pod not in result.delete
        assert source.model_identity == identity == pod.identity
    assert result.status.ready_sources == len(result.status.sources)
    assert result.requeue_after > 0 or observed.previous is not None
    # The Service's label goes to surviving serving pods handed their weights; the readiness
    # gate turns True for probed replicas only, and only where the pod shows otherwise.
    after = existing - set(result.delete)
    assert result.serve <= after, "labels a missing pod"
    for pod in (by_name[n] for n in result.serve):
        assert not pod.spare or pod.name in result.unspare, f"{pod.name}: a spare in the Service"
        handed = pod.name in result.handoff or (pod.handoff is not None and pod.handoff.given)
        assert handed and not pod.serving_labelled, f"{pod.name}: labelled waiting or twice"
    assert set(result.gates) <= after, "sets the gate of a missing pod"
    for name, passed in result.gates.items():
        pod = by_name[name]
        assert pod.probe_gate is not None and pod.probe_gate != passed, f"{name}: no transition"
        assert passed == pod.inference_ready, f"{name}: gate {passed} for an unprobed replica"


# ------------------------------------------------------------------------------ simulator


@dataclasses.dataclass
class Cluster:
    """Applies plans the way the handlers do; pods move only when a test moves them."""

    spec: ModelDeploymentSpec
    now: datetime = T0
    pods: dict[str, ObservedPod] = dataclasses.field(default_factory=dict)
    previous: ModelDeploymentStatus | None = None
    siblings: list[SourceEndpoint] = dataclasses.field(default_factory=list)
    plans: list[Plan] = dataclasses.field(default_factory=list)

    def observed(self) -> Observed:
        return observe(
            sorted(self.pods.values(), key=lambda p: p.name),
            now=self.now,
            previous=self.previous,
            siblings=self.siblings,
        )

    def reconcile(self) -> Plan:
        # Pods deleted by the previous plan finished terminating.
        self.pods = {n: p for n, p in self.pods.items() if not p.terminating}
        observed = self.observed()
        result = plan(self.spec, observed)
        check_plan(observed, result, self.spec)
        for name in result.delete:
            self.pods[name] = dataclasses.replace(
                self.pods[name], terminating=True, pod_ready=False
            )
        for name, role in result.relabel.items():
            self.pods[name] = dataclasses.replace(self.pods[name], role=role)
        for name, handoff in result.handoff.items():
            self.pods[name] = dataclasses.replace(self.pods[name], handoff=handoff)
        for name in result.unspare:
            self.pods[name] = dataclasses.replace(self.pods[name], spare=False)
        for name in result.serve:
            self.pods[name] = dataclasses.replace(self.pods[name], serving_labelled=True)
        for name, passed in result.gates.items():
            self.pods[name] = dataclasses.replace(self.pods[name], probe_gate=passed)
        for name, template in result.adopt.items():
            self.pods[name] = dataclasses.replace(self.pods[name], template=template)
        for desired in result.create:
            peers = [PeerCandidate(pod=s.pod, address=s.address) for s in desired.peers]
            self.pods[desired.name] = ObservedPod(
                name=desired.name,
                replica=desired.replica,
                identity=desired.identity,
                role=desired.role,
                handoff=PeerHandoff(peers=peers) if peers else None,
                spare=desired.spare,
                # As pods.render_pod: the gate on every pod, the Service's label once handed.
                probe_gate=False,
                serving_labelled=not desired.spare and (desired.role == Role.SOURCE or bool(peers)),
                template=pod_template_revision(self.spec),  # as pods.render_pod labels it
            )
        self.previous = result.status
        self.plans.append(result)
        return result

    def update(self, name: str, **changes: Any) -> None:
        self.pods[name] = dataclasses.replace(self.pods[name], **changes)

    def advance(self, name: str) -> None:
        """One step of a pod's life: scheduled -> running -> loaded -> probe passed."""
        pod = self.pods[name]
        if pod.node is None:
            self.update(name, node=f"gpu-{pod.replica}")
        elif pod.pod_ip is None:
            self.update(name, phase="Running", pod_ip=f"10.0.{pod.replica // 200}.{pod.replica}")
        elif pod.waiting_for_peers:
            # Standby: the worker did what needs no weights and waits to be handed peers.
            self.update(name, worker=WorkerReport(phase=WorkerPhase.STANDBY))
        elif pod.in_standby:  # handed peers or storage: it loads
            self.update(name, worker=WorkerReport(phase=WorkerPhase.LOADING))
        elif not pod.pod_ready:
            self.update(name, pod_ready=True)
        elif pod.probe is None or not pod.probe.passed:
            self.update(name, probe=ProbeResult(passed=True))

    def make_ready(self, name: str) -> None:
        for _ in range(4):
            self.advance(name)

    def live(self) -> list[ObservedPod]:
        """Serving pods that are not terminating (spares apart: `spares`)."""
        return [p for p in self.pods.values() if not p.terminating and not p.spare]

    def spares(self) -> list[ObservedPod]:
        return [p for p in self.pods.values() if not p.terminating and p.spare]

    def ready_count(self) -> int:
        return sum(p.inference_ready for p in self.live())

    def movable(self) -> list[str]:
        return sorted(
            (
                p.name
                for p in [*self.live(), *self.spares()]
                if not p.inference_ready
                and not p.failed
                and not (p.waiting_for_peers and p.in_standby)
            ),
            key=lambda n: (self.pods[n].replica, n),
        )

    def settle(self, steps: int = 200, on_step: Callable[[Cluster], None] | None = None) -> Plan:
        """Reconcile, advancing the lowest not-ready pod one step each time, until Ready."""
        result = self.reconcile()
        for _ in range(steps):
            settled = not result.create and not result.delete
            warm = all(p.in_standby for p in self.spares())
            if result.status.phase == Phase.READY and settled and warm:
                return result
            todo = self.movable()
            if todo:
                self.advance(todo[0])
            else:
                self.now += timedelta(seconds=self.spec.loading.wait_for_source_seconds + 1)
            result = self.reconcile()
            if on_step is not None:
                on_step(self)
        raise AssertionError(f"did not settle: {result.status.phase} {result.status.message}")


# ------------------------------------------------------------------------------ sequences


def no_sources(identity: str) -> list[Any]:
    """`sources_of` for a reconcile pass that sees no published sources in the index."""
    del identity
    return []


class RecordedApi:
    """The API writes a reconcile pass makes (kube.* patched out), recorded in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.created: list[dict[str, Any]] = []
        self.gates: list[tuple[str, str]] = []  # (pod, the gate condition's status)
        self.services: list[dict[str, Any]] = []
        monkeypatch.setattr(kube, "patch_pod_metadata", self._patch)
        monkeypatch.setattr(kube, "set_pod_condition", self._condition)
        monkeypatch.setattr(kube, "apply_service", lambda core, ns, svc: self.services.append(svc))
        monkeypatch.setattr(kube, "delete_service", lambda *a: None)
        monkeypatch.setattr(kube, "create_pod", self._create)
        monkeypatch.setattr(kube, "create_configmap", lambda *a: None)
        monkeypatch.setattr(kube, "ensure_owned_secret", lambda *a: None)
        monkeypatch.setattr(kube, "patch_status", lambda *a: None)
        monkeypatch.setattr(kube, "list_deployments", lambda *a: [])
        monkeypatch.setattr(kube, "max_node_gpus", lambda *a: 8)
        monkeypatch.setattr(kube, "post_event", lambda *a: None)

    def _patch(self, core: Any, namespace: str, name: str, metadata: dict[str, Any]) -> None:
        self.patches.append((name, metadata))

    def _condition(self, core: Any, namespace: str, name: str, condition: dict[str, Any]) -> None:
        self.gates.append((name, condition["status"]))

    def _create(self, core: Any, namespace: str, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest)
        return True

    @property
    def names(self) -> list[str]:
        """The created pods' names, in order."""
        return [m["metadata"]["name"] for m in self.created]
