# The kubernetes client's models type every field Optional; these tests read objects the API
# server returned and fail loudly (AttributeError/TypeError) if a field is absent.
# mypy: disable-error-code="union-attr,index,arg-type"
"""The operator (`weightlift operator`, running as the chart's ServiceAccount) against the real
control plane. kwok makes bound pods Running/Ready but runs no worker, so no inference probe can
pass: these tests assert roles, scheduling, phases, conditions and pod counts, never Ready."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client

from tests.support.cluster import OPERATOR_NAMESPACE, Kubectl, OperatorProcess, wait_for
from weightlift.local.history import History, Version
from weightlift.operator import applygate

NS = OPERATOR_NAMESPACE
GROUP, VERSION, PLURAL = "weightlift.dev", "v1alpha1", "modeldeployments"
DEPLOYMENT_LABEL = "weightlift.dev/deployment"
SPARE_LABEL = "weightlift.dev/spare"
ROLE_LABEL = "weightlift.dev/role"
REPLICA_LABEL = "weightlift.dev/replica"
FINALIZER = "weightlift.dev/finalizer"
FENCE_ANNOTATION = "test.weightlift.dev/fence"


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"uri": f"file:///models/{name}"}, "replicas": 1},
    }
    body["spec"].update(spec)
    return body


class Env:
    def __init__(
        self, core: client.CoreV1Api, custom: client.CustomObjectsApi, kubectl: Kubectl
    ) -> None:
        self.core, self.custom, self.kubectl = core, custom, kubectl
        self.created: list[str] = []

    def create(self, name: str, **spec: Any) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, **spec)))
        self.created.append(name)

    def md(self, name: str) -> dict[str, Any]:
        obj = cast(
            dict[str, Any],
            self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name),
        )
        return obj

    def status(self, name: str) -> dict[str, Any]:
        st: dict[str, Any] = self.md(name).get("status") or {}
        return st

    def pods(self, name: str, *, live: bool = True) -> list[client.V1Pod]:
        items = self.core.list_namespaced_pod(NS, label_selector=f"{DEPLOYMENT_LABEL}={name}").items
        return [p for p in items if not (live and p.metadata.deletion_timestamp)]

    def wait_pods(self, name: str, count: int, timeout: float = 60) -> list[client.V1Pod]:
        def check() -> list[client.V1Pod]:
            pods = self.pods(name)
            return pods if len(pods) == count else []

        return wait_for(check, timeout, f"{count} live pods of {name}")

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any]:
            st = self.status(name)
            return st if st.get("phase") == phase else {}

        try:
            return wait_for(check, timeout, f"{name} phase {phase}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; status now: {json.dumps(self.status(name))}") from None


@pytest.fixture
def env(
    operator: OperatorProcess,
    core: client.CoreV1Api,
    custom: client.CustomObjectsApi,
    kubectl: Kubectl,
) -> Iterator[Env]:
    assert operator.alive(), operator.log()[-3000:]
    e = Env(core, custom, kubectl)
    yield e
    for name in e.created:
        kubectl("delete", "-n", NS, f"md/{name}", "--ignore-not-found", "--wait=false")
    assert operator.alive(), f"operator died:\n{operator.log()[-3000:]}"


def _gpus(pod: client.V1Pod) -> str:
    return str(pod.spec.containers[0].resources.requests.get("nvidia.com/gpu"))


def test_every_replica_at_once_first_is_source_and_nothing_unprobed_is_ready(env: Env) -> None:
    env.create("roles", replicas=3, parallelism={"tensor": 2}, loading={"waitForSourceSeconds": 15})
    # Standby: every replica's pod at once; the first is the Source, the others Targets. (kwok
    # runs no worker, so no Target ever reports Standby here: the hand-off itself is covered
    # with real workers by tests/e2e/test_standby.py.)
    pods = env.wait_pods("roles", 3)
    roles = {p.metadata.labels[REPLICA_LABEL]: p.metadata.labels[ROLE_LABEL] for p in pods}
    assert roles == {"0": "Source", "1": "Target", "2": "Target"}
    source = next(p for p in pods if p.metadata.labels[ROLE_LABEL] == "Source")
    assert _gpus(source) == "2"  # GPU request = tensor-parallel size
    owner = source.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("ModelDeployment", "roles", True)
    # the real scheduler binds every replica to a GPU node; kwok makes them Running/Ready
    wait_for(lambda: all(p.spec.node_name for p in env.pods("roles")), 30, "replicas bound")
    assert all(p.spec.node_name.startswith("gpu-node-") for p in env.pods("roles"))
    # no replica passes an inference probe (kwok runs no worker): nothing is called Ready
    st = env.wait_phase("roles", "Probing", timeout=60)
    assert st["readyReplicas"] == 0
    assert st["sources"] == []
    assert st["selector"] == f"{DEPLOYMENT_LABEL}=roles,!{SPARE_LABEL}"
    assert sorted(r["role"] for r in st["replicaStatuses"]) == ["Source", "Target", "Target"]
    assert all(r["node"].startswith("gpu-node-") for r in st["replicaStatuses"])
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "Probing"
    reasons = {
        e.reason
        for e in env.core.list_namespaced_event(NS).items
        if e.involved_object.name == "roles"
    }
    # Progress is announced by the status and its conditions, not by Events (issue 34).
    assert not reasons & {"PhasePending", "PhaseLoading", "PhaseProbing"}, reasons


def test_scheduler_respects_gpu_requests_and_node_selector(env: Env) -> None:
    # 4 nodes x 8 GPUs; tensor=8 needs a whole node each: 4 fit, the 5th cannot
    env.create(
        "packed",
        replicas=5,
        parallelism={"tensor": 8},
        loading={"waitForSourceSeconds": 0},
        template={"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
    )

    def placed() -> list[client.V1Pod]:
        pods = env.pods("packed")
        return pods if len([p for p in pods if p.spec.node_name]) == 4 and len(pods) == 5 else []

    pods = wait_for(placed, 90, "4 of 5 whole-node pods bound")
    nodes = [p.spec.node_name for p in pods if p.spec.node_name]
    assert len(set(nodes)) == 4  # one per node: GPU requests are honoured
    assert all(_gpus(p) == "8" for p in pods)
    assert all(
        p.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"} for p in pods
    )

    def surfaced() -> dict[str, Any]:
        # The status as it settles: the condition may come in a write that still lists bound
        # pods without their node (their binding not yet seen), so wait for the 4 nodes too.
        st = env.status("packed")
        sched = {c["type"]: c for c in st.get("conditions", [])}.get("Scheduled", {})
        ok = sched.get("status") == "False" and sched.get("reason") == "Unschedulable"
        placed = [r for r in st.get("replicaStatuses", []) if r.get("node")]
        return st if ok and len(placed) == 4 else {}

    try:
        st = wait_for(surfaced, 60, "Scheduled=False/Unschedulable and 4 replicas placed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {json.dumps(env.status('packed'))}") from None
    pending = [r for r in st["replicaStatuses"] if not r.get("node")]
    assert len(pending) == 1
    assert "Insufficient nvidia.com/gpu" in pending[0]["message"]
    assert st["phase"] == "Pending"
    assert f"{pending[0]['name']} unschedulable" in st["message"]
    env.kubectl("delete", "-n", NS, "md/packed", "--wait=false")
    # free the GPUs for the other tests
    wait_for(lambda: env.pods("packed", live=False) == [], 60, "packed pods gone")


def test_unschedulable_node_selector_is_surfaced_in_status(env: Env) -> None:
    env.create("nofit", template={"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}})
    pod = env.wait_pods("nofit", 1)[0]
    assert pod.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-B200"}

    def surfaced() -> dict[str, Any]:
        st = env.status("nofit")
        return st if "unschedulable" in st.get("message", "") else {}

    st = wait_for(surfaced, 60, "unschedulable in status.message")
    assert st["phase"] == "Pending"
    assert "node affinity/selector" in st["message"] or "didn't match" in st["message"]
    sched = {c["type"]: c for c in st["conditions"]}["Scheduled"]
    assert sched["status"] == "False"
    assert env.pods("nofit")[0].spec.node_name is None


def test_rejected_pod_creation_is_surfaced_in_status(env: Env) -> None:
    """The API server refuses the worker pod (its ServiceAccount does not exist): the status
    must say so; an event alone is not enough."""
    env.create("nosa", template={"serviceAccountName": "no-such-sa"})

    def surfaced() -> dict[str, Any]:
        st = env.status("nosa")
        return st if "no-such-sa" in st.get("message", "") else {}

    try:
        st = wait_for(surfaced, 30, "the rejected pod creation in status.message")
    except AssertionError as exc:
        events = [
            f"{e.reason}: {e.message}"
            for e in env.core.list_namespaced_event(NS).items
            if e.involved_object.name == "nosa"
        ]
        raise AssertionError(
            f"{exc}; status: {json.dumps(env.status('nosa'))}; events: {events}"
        ) from None
    assert st["phase"] in ("Pending", "Failed")
    scheduled = {c["type"]: c for c in st["conditions"]}["Scheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "FailedCreate")
    assert "HTTP response headers" not in st["message"]
    assert env.pods("nosa") == []


def test_tensor_parallel_larger_than_any_node_fails_fast(env: Env) -> None:
    env.create("toowide", parallelism={"tensor": 16})
    st = env.wait_phase("toowide", "Failed", timeout=60)
    assert "16" in st["message"] and "8" in st["message"], st["message"]
    assert env.pods("toowide") == []


def test_scale_subresource_up_and_down(env: Env) -> None:
    env.create("scaled", replicas=1, loading={"waitForSourceSeconds": 0})
    env.wait_pods("scaled", 1)
    env.kubectl("scale", "-n", NS, "md/scaled", "--replicas=3")
    pods = env.wait_pods("scaled", 3)
    assert sorted(p.metadata.labels[REPLICA_LABEL] for p in pods) == ["0", "1", "2"]
    wait_for(lambda: env.status("scaled").get("replicas") == 3, 30, "status.replicas == 3")
    env.kubectl("scale", "-n", NS, "md/scaled", "--replicas=1")
    pods = env.wait_pods("scaled", 1)
    assert [p.metadata.labels[REPLICA_LABEL] for p in pods] == ["0"]  # highest go first
    # kwok completes the deletion: the removed pods are really gone, not just terminating
    wait_for(lambda: len(env.pods("scaled", live=False)) == 1, 60, "scaled-down pods gone")
    st = wait_for(
        lambda: (s := env.status("scaled")).get("replicas") == 1 and s, 30, "status.replicas == 1"
    )
    assert st["ready"] == "0/1"
    scale = json.loads(
        env.kubectl(
            "get", "--raw", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/scaled/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 1
    assert scale["status"]["selector"] == f"{DEPLOYMENT_LABEL}=scaled,!{SPARE_LABEL}"


def test_deletion_with_finalizer_leaves_no_pods(env: Env) -> None:
    env.create("doomed", replicas=2, loading={"waitForSourceSeconds": 0})
    env.wait_pods("doomed", 2)
    wait_for(
        lambda: FINALIZER in (env.md("doomed")["metadata"].get("finalizers") or []),
        30,
        "operator finalizer on the ModelDeployment",
    )
    env.kubectl("delete", "-n", NS, "md/doomed", "--timeout=60s")

    def gone() -> bool:
        try:
            env.md("doomed")
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_for(gone, 60, "ModelDeployment gone (finalizer released)")
    wait_for(lambda: env.pods("doomed", live=False) == [], 60, "no pods left")


def _fence(env: Env, pods: History, pod: str, mark: str) -> Version:
    """A known point in the pod events: annotate `pod`, wait for that change to come back. The
    events before it are every change made to the deployment's pods before the annotation."""
    patch = {"metadata": {"annotations": {FENCE_ANNOTATION: mark}}}
    env.core.patch_namespaced_pod(pod, NS, patch)
    return pods.wait(lambda c: c.annotations.get(FENCE_ANNOTATION) == mark, 30, f"fence {mark}")


def _made(changes: list[Version]) -> list[str]:
    return [c.name for c in changes if c.type == "ADDED"]


def test_operator_restart_mid_reconcile_converges(
    env: Env, operator: OperatorProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILLed (no graceful cleanup, like a crashed pod) in the pass that creates the pods,
    after its first pod and before the others: the gate (operator/applygate.py) holds the pass
    there. Nothing reconciles while it is down; a new operator, which finds one pod and a spec
    scaled meanwhile, creates each missing replica once and keeps the one it found."""
    gate = tmp_path / "gate"
    operator.stop()  # started again with the gate's env, which only this test sets
    monkeypatch.setenv(applygate.GATE_DIR_ENV, str(gate))
    applygate.arm(gate, "restart")
    with History.pods(env.kubectl.kubeconfig, NS, "restart") as pods:
        try:
            operator.start()
            env.create("restart", replicas=3, loading={"waitForSourceSeconds": 0})
            held = wait_for(lambda: applygate.holding(gate, "restart"), 60, "the held pass")
            operator.stop(kill=True)
            assert not operator.alive()
            # Exactly the pass's first pod was made before the kill, the other two were not.
            assert len(held.created) == 1 and len(held.pending) == 2, held
            (first,) = held.created
            killed = _fence(env, pods, first, "killed")
            before = pods.upto(killed)[:-1]
            assert _made(before) == [first], [(c.type, c.name) for c in before]
            env.kubectl("scale", "-n", NS, "md/restart", "--replicas=4")
            # Nobody reconciles meanwhile: not a pod made or deleted while no operator runs.
            down = _fence(env, pods, first, "down")
            quiet = [(c.type, c.name) for c in pods.between(killed, down)]
            assert all(kind == "MODIFIED" for kind, _ in quiet), quiet
        finally:
            operator.stop(kill=True)  # the gated one, if a check above failed while it held
            monkeypatch.delenv(applygate.GATE_DIR_ENV)
            operator.start()
        live = env.wait_pods("restart", 4, timeout=90)
        assert sorted(p.metadata.labels[REPLICA_LABEL] for p in live) == ["0", "1", "2", "3"]
        st = wait_for(
            lambda: (s := env.status("restart")).get("replicas") == 4 and s, 60, "status.replicas 4"
        )
        assert st["observedGeneration"] == env.md("restart")["metadata"]["generation"]
        # The new operator made each missing replica once and kept (did not replace) the first:
        # no pod deleted, none added twice, from the deployment's creation on.
        done = _fence(env, pods, first, "done")
        churn = sorted((c.type, c.name) for c in pods.upto(done) if c.type != "MODIFIED")
        assert churn == sorted(("ADDED", str(p.metadata.name)) for p in live), churn


def test_a_source_a_sibling_publishes_feeds_a_new_deployment_at_once(env: Env) -> None:
    """Issue 12: a ModelDeployment created right after a sibling published a Ready source of its
    identity pulls from it; none of its replicas loads from storage. The sibling's source is
    written here the way the operator publishes one (status.sources and readySources in one
    write): kwok runs no worker, so no replica of this cluster can pass an inference probe
    itself."""
    shared = {"uri": "file:///models/shared"}
    env.create("feeder", replicas=0, model=shared, parallelism={"tensor": 2})
    identity = wait_for(lambda: env.status("feeder").get("modelIdentity"), 30, "feeder identity")
    source = {
        "pod": "feeder-pod-0",
        "deployment": "feeder",
        "address": "10.99.0.1:8000",
        "modelIdentity": identity,
        "ranks": [0, 1],
    }
    published = {"sources": [source], "readySources": 1}
    env.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "feeder", {"status": published}
    )

    # The CRD's selectableFields: the API server finds the publisher by its status alone.
    def publishers(of: str) -> list[str]:
        selector = f"status.modelIdentity={of},status.readySources!=0"
        found = env.custom.list_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, field_selector=selector
        )
        return [md["metadata"]["name"] for md in found["items"]]

    assert publishers(identity) == ["feeder"]
    assert publishers("0" * 16) == []

    env.create("eater", replicas=2, model=shared, parallelism={"tensor": 2})
    pods = env.wait_pods("eater", 2, timeout=60)
    assert {p.metadata.labels[ROLE_LABEL] for p in pods} == {"Target"}
    for pod in pods:
        env_vars = {e.name: e.value for e in pod.spec.containers[0].env}
        plan = json.loads(env_vars["WEIGHTLIFT_ASSIGNMENT"])  # peers: the per-replica part
        assert [(p["pod"], p["address"]) for p in plan["peers"]] == [
            ("feeder-pod-0", "10.99.0.1:8000")
        ]


def _plan_maps(env: Env, name: str) -> list[client.V1ConfigMap]:
    selector = f"{DEPLOYMENT_LABEL}={name},weightlift.dev/plan"
    return list(env.core.list_namespaced_config_map(NS, label_selector=selector).items)


def test_plans_and_peer_tokens_live_beside_the_pods_and_go_with_their_owners(env: Env) -> None:
    """One immutable plan ConfigMap per revision (the pods' digest matches it, the garbage
    collector removes it with its ModelDeployment); one token Secret per model identity, owned
    by every ModelDeployment of that identity, referenced by the pods, never in the plan."""
    shared = {"uri": "file:///models/planned"}
    env.create("planner", replicas=2, model=shared, loading={"waitForSourceSeconds": 0})
    pods = env.wait_pods("planner", 2)
    (plan,) = wait_for(lambda: _plan_maps(env, "planner"), 30, "the plan ConfigMap")
    assert plan.immutable is True
    text = plan.data["plan.json"]
    digest = hashlib.sha256(text.encode()).hexdigest()
    identity = (
        env.status("planner").get("modelIdentity")
        or pods[0].metadata.labels["weightlift.dev/identity"]
    )
    token_name = f"weightlift-peer-{identity}"
    for pod in pods:
        env_vars = {e.name: e for e in pod.spec.containers[0].env}
        assert env_vars["WEIGHTLIFT_PLAN_SHA256"].value == digest
        assert env_vars["WEIGHTLIFT_PLAN_CONFIGMAP"].value == plan.metadata.name
        assert env_vars["WEIGHTLIFT_PEER_TOKEN"].value_from.secret_key_ref.name == token_name
        volume = next(v for v in pod.spec.volumes if v.name == "plan")
        assert volume.config_map.name == plan.metadata.name
    secret = env.core.read_namespaced_secret(token_name, NS)
    token = base64.b64decode(secret.data["token"]).decode()
    assert len(token) >= 40 and token not in text
    planner_uid = env.md("planner")["metadata"]["uid"]
    assert [o.uid for o in secret.metadata.owner_references] == [planner_uid]
    # The ConfigMap cannot be edited in place.
    with pytest.raises(client.ApiException) as refused:
        env.core.patch_namespaced_config_map(plan.metadata.name, NS, {"data": {"plan.json": "{}"}})
    assert refused.value.status == 422

    env.create("sibling", replicas=1, model=shared, loading={"waitForSourceSeconds": 0})
    env.wait_pods("sibling", 1)
    sibling_uid = env.md("sibling")["metadata"]["uid"]

    def owners() -> set[str]:
        found = env.core.read_namespaced_secret(token_name, NS).metadata.owner_references
        return {o.uid for o in found or []}

    wait_for(lambda: owners() == {planner_uid, sibling_uid}, 30, "both owners on the token")
    token_again = base64.b64decode(env.core.read_namespaced_secret(token_name, NS).data["token"])
    assert token_again.decode() == token  # shared, not replaced

    env.kubectl("delete", "-n", NS, "md/planner", "--timeout=60s")
    wait_for(lambda: _plan_maps(env, "planner") == [], 60, "plan ConfigMap collected")
    wait_for(lambda: owners() == {sibling_uid}, 60, "the token outlives one of its owners")
    env.kubectl("delete", "-n", NS, "md/sibling", "--timeout=60s")

    def token_gone() -> bool:
        try:
            env.core.read_namespaced_secret(token_name, NS)
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_for(token_gone, 60, "token collected with its last owner")
