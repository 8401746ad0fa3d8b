# The kubernetes client's models type every field Optional; these tests read objects the API
# server returned and fail loudly (AttributeError/TypeError) if a field is absent.
# mypy: disable-error-code="union-attr,index,arg-type"
"""Worker pods in a namespace that enforces PodSecurity `restricted` (issue 45), against the real
API server's PodSecurity admission: the plain worker is admitted; the operator's node compile
store (a hostPath) is dropped there with an Event; what the user asked for that needs `baseline`
(RDMA's IPC_LOCK, a hostpath:// model) is refused with the spec's field named in the status.

The operator keeps "this namespace refused the node store" for its life: later vLLM pods in the
operator tests' namespace are rendered without it (no integration test reads that store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_operator_live import NS, Env
from tests.integration.test_operator_live import env as operator_env  # noqa: F401 (the fixture)
from tests.support.cluster import Kubectl, wait_for

ENFORCE = "pod-security.kubernetes.io/enforce"
VLLM: dict[str, Any] = {
    "model": {"uri": "file:///models/psa-vllm", "format": "safetensors"},
    "runtime": {"engine": "vLLM"},
}


@pytest.fixture
def env(operator_env: Env, kubectl: Kubectl) -> Iterator[Env]:  # noqa: F811
    """The operator tests' Env, their namespace enforcing `restricted` while the test runs."""
    kubectl("label", "namespace", NS, f"{ENFORCE}=restricted", "--overwrite")
    try:
        yield operator_env
    finally:
        kubectl("label", "namespace", NS, f"{ENFORCE}-")


def _volumes(pod: Any) -> dict[str, Any]:
    return {v.name: v for v in pod.spec.volumes}


def _refusal(env: Env, name: str) -> str:
    def refused() -> str:
        message = str(env.status(name).get("message") or "")
        return message if "violates PodSecurity" in message else ""

    return wait_for(refused, 60, f"{name}'s status to say PodSecurity refused its pod")


def test_a_plain_worker_pod_is_admitted_where_restricted_is_enforced(env: Env) -> None:
    env.create("psa-plain")
    (pod,) = env.wait_pods("psa-plain", 1)
    assert not [v.name for v in pod.spec.volumes if v.host_path is not None]
    assert "message" not in env.status("psa-plain") or "PodSecurity" not in str(
        env.status("psa-plain")["message"]
    )


def test_the_node_compile_store_is_dropped_with_an_event_where_restricted_refuses_it(
    env: Env, kubectl: Kubectl
) -> None:
    env.create("psa-vllm", **VLLM)
    (pod,) = env.wait_pods("psa-vllm", 1)
    assert "compile-store" not in _volumes(pod)
    env_names = {e.name for e in pod.spec.containers[0].env}
    assert "WEIGHTLIFT_COMPILE_STORE" not in env_names

    def event() -> str:
        out = kubectl(
            "get", "events", "-n", NS, "--field-selector",
            "involvedObject.name=psa-vllm,reason=NodeCompileStoreOff",
            "-o", "jsonpath={.items[*].message}",
        ).stdout  # fmt: skip
        return out

    message = wait_for(event, 30, "the NodeCompileStoreOff Event")
    assert "hostPath" in message and "compileStoreUri" in message


@pytest.mark.parametrize(
    ("name", "spec", "field"),
    [
        ("psa-rdma", {"template": {"rdmaResource": "rdma/ib"}}, "spec.template.rdmaResource"),
        ("psa-hostpath", {"model": {"uri": "hostpath:///models/psa"}}, "spec.model.uri hostpath"),
    ],
)
def test_what_needs_baseline_is_refused_naming_the_field(
    env: Env, name: str, spec: dict[str, Any], field: str
) -> None:
    env.create(name, **spec)
    message = _refusal(env, name)
    assert field in message and "baseline" in message, message
    assert f"namespace {NS}" in message
    assert not env.pods(name)
    scheduled = next(c for c in env.status(name)["conditions"] if c["type"] == "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "FailedCreate")
