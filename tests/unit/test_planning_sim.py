"""Planning over time: a tiny cluster simulator applies each Plan, advances pods, re-plans.

Factories and the simulator live here and are imported by the other planning test modules;
the tests in this module drive whole sequences (cold start, rollover, failures) and check
invariants after every reconcile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from weightlift.operator.api import (
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    Phase,
    ProbeResult,
    Role,
    SourceEndpoint,
)
from weightlift.operator.identity import model_identity
from weightlift.operator.planning import Observed, ObservedPod, Plan, plan, pod_name
from weightlift.worker.plan import WorkerReport

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
    deleting: bool = False,
    max_node_gpus: int | None = 8,
    generation: int = 3,
) -> Observed:
    return Observed(
        name=NAME,
        namespace=NAMESPACE,
        generation=generation,
        now=now,
        pods=list(pods or []),
        sibling_sources=list(siblings or []),
        previous=previous,
        deleting=deleting,
        max_node_gpus=max_node_gpus,
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
    for desired in result.create:
        assert desired.identity == identity
        assert desired.name == pod_name(NAME, identity, desired.replica)
        if desired.role == Role.SOURCE:
            assert desired.peers == [], "a storage source gets no peers"
        else:
            assert desired.peers, "a target needs at least one peer candidate"
            assert all(p.model_identity == identity for p in desired.peers)
    if observed.deleting:
        assert not result.create and not result.relabel
        assert set(result.delete) >= {p.name for p in observed.pods if not p.terminating}
        return
    live_after = [p for p in observed.pods if not p.terminating and p.name not in result.delete]
    if result.create:
        total = len(live_after) + len(result.create)
        assert total <= spec.replicas + spec.rollout.max_surge, "surge exceeded"
        current_after = sum(p.identity == identity for p in live_after) + len(result.create)
        assert current_after <= spec.replicas, "created more than replicas of the identity"
    # Sources published in the status are Ready pods of this deployment that survive the plan.
    by_name = {p.name: p for p in observed.pods}
    for source in result.status.sources:
        pod = by_name[source.pod]
        assert pod.inference_ready and source.pod not in result.delete
        assert source.model_identity == identity == pod.identity
    assert result.status.ready_sources == len(result.status.sources)
    assert result.requeue_after > 0 or observed.previous is not None


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

    def observed(self, deleting: bool = False) -> Observed:
        return observe(
            sorted(self.pods.values(), key=lambda p: p.name),
            now=self.now,
            previous=self.previous,
            siblings=self.siblings,
            deleting=deleting,
        )

    def reconcile(self, deleting: bool = False) -> Plan:
        # Pods deleted by the previous plan finished terminating.
        self.pods = {n: p for n, p in self.pods.items() if not p.terminating}
        observed = self.observed(deleting)
        result = plan(self.spec, observed)
        check_plan(observed, result, self.spec)
        for name in result.delete:
            self.pods[name] = dataclasses.replace(
                self.pods[name], terminating=True, pod_ready=False
            )
        for name, role in result.relabel.items():
            self.pods[name] = dataclasses.replace(self.pods[name], role=role)
        for desired in result.create:
            self.pods[desired.name] = ObservedPod(
                name=desired.name,
                replica=desired.replica,
                identity=desired.identity,
                role=desired.role,
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
        elif not pod.pod_ready:
            self.update(name, pod_ready=True)
        elif pod.probe is None or not pod.probe.passed:
            self.update(name, probe=ProbeResult(passed=True))

    def make_ready(self, name: str) -> None:
        for _ in range(4):
            self.advance(name)

    def live(self) -> list[ObservedPod]:
        return [p for p in self.pods.values() if not p.terminating]

    def ready_count(self) -> int:
        return sum(p.inference_ready for p in self.live())

    def movable(self) -> list[str]:
        return sorted(
            (p.name for p in self.live() if not p.inference_ready and not p.failed),
            key=lambda n: (self.pods[n].replica, n),
        )

    def settle(self, steps: int = 200, on_step: Callable[[Cluster], None] | None = None) -> Plan:
        """Reconcile, advancing the lowest not-ready pod one step each time, until Ready."""
        result = self.reconcile()
        for _ in range(steps):
            if result.status.phase == Phase.READY and not result.create and not result.delete:
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


@pytest.mark.parametrize("replicas", [0, 1, 2, 5])
@pytest.mark.parametrize("strategy", ["Auto", "PeerToPeer", "Preload", "Direct"])
def test_cold_start_settles_ready_with_the_right_roles(replicas: int, strategy: str) -> None:
    cluster = Cluster(make_spec(replicas, strategy=strategy))
    final = cluster.settle()
    live = cluster.live()
    assert len(live) == replicas
    assert sorted(p.replica for p in live) == list(range(replicas))
    assert final.status.phase == Phase.READY
    assert final.status.ready == f"{replicas}/{replicas}"
    assert final.status.ready_replicas == replicas
    roles = {p.replica: p.role for p in live}
    if strategy in ("Preload", "Direct"):
        assert set(roles.values()) <= {Role.SOURCE}
    elif replicas:
        assert roles[0] == Role.SOURCE
        assert all(roles[i] == Role.TARGET for i in range(1, replicas))
    assert [c.status for c in final.status.conditions] == ["True"] * 4


def test_cold_start_targets_wait_until_the_source_passes_its_probe() -> None:
    cluster = Cluster(make_spec(3))
    first = cluster.reconcile()
    assert [(d.replica, d.role) for d in first.create] == [(0, Role.SOURCE)]
    assert first.status.waiting_since is not None
    source = first.create[0].name
    for _ in range(3):  # scheduled, running, loaded (probe not yet passed)
        cluster.advance(source)
        step = cluster.reconcile()
        assert step.create == [], "targets must wait for a Ready source"
        assert step.status.waiting_since == first.status.waiting_since
        assert step.status.sources == []
    cluster.advance(source)  # probe passes
    step = cluster.reconcile()
    assert [(d.replica, d.role) for d in step.create] == [(1, Role.TARGET), (2, Role.TARGET)]
    assert all([p.pod for p in d.peers] == [source] for d in step.create)
    assert step.status.waiting_since is None
    assert [s.pod for s in step.status.sources] == [source]


def test_wait_for_source_expiry_loads_remaining_replicas_from_storage() -> None:
    cluster = Cluster(make_spec(3, wait=60))
    first = cluster.reconcile()
    cluster.now += timedelta(seconds=59)
    early = cluster.reconcile()
    assert early.create == []
    assert early.requeue_after <= 1.0
    cluster.now += timedelta(seconds=2)
    late = cluster.reconcile()
    assert [(d.replica, d.role) for d in late.create] == [(1, Role.SOURCE), (2, Role.SOURCE)]
    assert "WaitForSourceExpired" in [e.reason for e in late.events]
    assert late.status.waiting_since is None
    assert first.status.waiting_since is not None


def _rolled(spec: ModelDeploymentSpec, field: str) -> ModelDeploymentSpec:
    changes: dict[str, dict[str, Any]] = {
        "uri": {"model": {"uri": "pvc://models/llama-4"}},
        "revision": {"model": {"revision": "v2"}},
        "format": {
            "model": {"format": "safetensors"},
            "runtime": {"type": "External", "command": ["serve"]},
        },
        "dtype": {"model": {"dtype": "bfloat16"}},
        "tensor": {"parallelism": {"tensor": 2}},
    }
    body = spec.model_dump(by_alias=True)
    for key, value in changes[field].items():
        body[key] = {**body[key], **value}
    return ModelDeploymentSpec.model_validate(body)


@pytest.mark.parametrize("field", ["uri", "revision", "format", "dtype", "tensor"])
@pytest.mark.parametrize(("replicas", "surge"), [(1, 1), (3, 1), (3, 2), (4, 4)])
def test_rollover_never_drops_below_the_ready_count(field: str, replicas: int, surge: int) -> None:
    cluster = Cluster(make_spec(replicas, max_surge=surge))
    cluster.settle()
    old_identity = ident(cluster.spec)
    ready_before = cluster.ready_count()
    assert ready_before == replicas
    cluster.spec = _rolled(cluster.spec, field)
    new_identity = ident(cluster.spec)
    assert new_identity != old_identity

    def invariant(c: Cluster) -> None:
        assert c.ready_count() >= min(replicas, ready_before)
        assert len(c.live()) <= replicas + surge
        assert c.previous is not None and c.previous.ready_replicas >= min(replicas, ready_before)

    final = cluster.settle(on_step=invariant)
    assert {p.identity for p in cluster.live()} == {new_identity}
    assert cluster.ready_count() == replicas
    assert final.status.updated_replicas == replicas
    assert final.status.model_identity == new_identity
    # The first new replica loads from storage; the others pull from it (an External runtime,
    # which a safetensors model needs, loads its own weights: every replica from storage).
    roles = sorted((p.replica, p.role) for p in cluster.live())
    assert roles[0][1] == Role.SOURCE
    expected_rest = Role.SOURCE if field == "format" else Role.TARGET
    assert all(role == expected_rest for _, role in roles[1:])


def test_rollover_to_a_permanently_broken_identity_keeps_old_replicas_serving() -> None:
    cluster = Cluster(make_spec(2))
    cluster.settle()
    cluster.spec = _rolled(cluster.spec, "revision")
    step = cluster.reconcile()
    (new,) = step.create
    cluster.update(
        new.name,
        node="gpu-9",
        phase="Failed",
        worker=WorkerReport(phase="Failed", permanent_failure=True, message="bad header"),
    )
    for _ in range(3):
        step = cluster.reconcile()
        assert step.delete == {} and step.create == []
        assert cluster.ready_count() == 2
    assert step.status.phase == Phase.FAILED
    assert "bad header" in step.status.message


def test_source_failure_promotes_a_ready_target_and_replaces_the_source() -> None:
    cluster = Cluster(make_spec(3))
    cluster.settle()
    source = next(p for p in cluster.live() if p.role == Role.SOURCE)
    cluster.update(source.name, phase="Failed", failure="Evicted", pod_ready=False)
    step = cluster.reconcile()
    assert source.name in step.delete
    assert step.relabel == {pod_name(NAME, ident(cluster.spec), 1): Role.SOURCE}
    assert "Promoted" in [e.reason for e in step.events]
    (replacement,) = step.create
    assert replacement.role == Role.TARGET and replacement.replica == 3
    assert {p.pod for p in replacement.peers} == {
        pod_name(NAME, ident(cluster.spec), 1),
        pod_name(NAME, ident(cluster.spec), 2),
    }
    final = cluster.settle()
    assert final.status.phase == Phase.READY
    assert sum(p.role == Role.SOURCE for p in cluster.live()) == 1


def test_deletion_removes_every_pod_and_creates_none() -> None:
    cluster = Cluster(make_spec(3))
    cluster.settle()
    cluster.reconcile(deleting=True)
    assert cluster.live() == []
    assert cluster.reconcile(deleting=True).create == []


def test_scale_to_zero_and_back() -> None:
    cluster = Cluster(make_spec(3))
    cluster.settle()
    cluster.spec = make_spec(0)
    down = cluster.reconcile()
    assert len(down.delete) == 3
    assert down.status.ready == "3/0"  # the status reports what it saw: still serving
    assert cluster.live() == []
    gone = cluster.reconcile()
    assert gone.status.ready == "0/0" and gone.status.phase == Phase.READY
    assert gone.delete == {} and gone.create == []
    cluster.spec = make_spec(2)
    final = cluster.settle()
    assert final.status.ready == "2/2"
    assert sorted(p.role for p in cluster.live()) == [Role.SOURCE, Role.TARGET]
