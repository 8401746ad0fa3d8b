"""The chart's RBAC on a real API server: the operator's ServiceAccount can do exactly what the
operator needs (and the operator, running under it, never hits a 403); the rest is forbidden."""

from __future__ import annotations

import json

import pytest

from tests.support.cluster import (
    OPERATOR_NAMESPACE,
    RELEASE,
    ChartRbac,
    Kubectl,
    OperatorProcess,
    wait_for,
)

NS = OPERATOR_NAMESPACE


def can_i(kubectl: Kubectl, user: str, namespace: str, verb: str, resource: str) -> bool:
    sa_ns = user.split(":")[2]
    # kubectl resolves "pods/exec" to "pods"; the subresource must be a separate flag
    resource, _, sub = resource.partition("/")
    proc = kubectl(
        "auth", "can-i", verb, resource, *([f"--subresource={sub}"] if sub else []), f"--as={user}",
        "--as-group=system:serviceaccounts", f"--as-group=system:serviceaccounts:{sa_ns}",
        "--as-group=system:authenticated",
        *(["-n", namespace] if namespace else []),
        check=False,
    )  # fmt: skip
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stderr
    return answer == "yes"


NEEDED: list[tuple[str, str]] = [
    ("get", "modeldeployments.weightlift.dev"),
    ("list", "modeldeployments.weightlift.dev"),
    ("watch", "modeldeployments.weightlift.dev"),
    ("patch", "modeldeployments.weightlift.dev"),  # finalizer, kopf annotations
    ("patch", "modeldeployments.weightlift.dev/status"),
    ("get", "pods"),
    ("list", "pods"),
    ("watch", "pods"),
    ("create", "pods"),
    ("delete", "pods"),
    ("patch", "pods"),  # role label on promotion
    ("create", "events"),
    ("create", "configmaps"),  # the plan of each revision
    ("deletecollection", "configmaps"),  # older revisions' plans
    ("create", "secrets"),  # the P2P token of each model identity
    ("patch", "secrets"),  # another owner of that token
    ("patch", "pods/status"),  # the inference-probe readiness gate's condition
    ("create", "services"),  # spec.service, server-side applied
    ("patch", "services"),
    ("delete", "services"),  # spec.service.enabled turned false
]
NEEDED_CLUSTER: list[tuple[str, str]] = [
    ("list", "nodes"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
]
FORBIDDEN: list[tuple[str, str]] = [
    ("create", "modeldeployments.weightlift.dev"),  # users own their specs
    ("update", "modeldeployments.weightlift.dev"),
    ("delete", "modeldeployments.weightlift.dev"),
    ("get", "secrets"),  # tokens and credentials reach workers by secretKeyRef, not through it
    ("list", "secrets"),
    ("watch", "secrets"),
    ("get", "configmaps"),
    ("update", "configmaps"),
    ("create", "pods/exec"),
    ("update", "pods/status"),
    ("get", "services"),  # never read back
    ("update", "services"),
    ("create", "deployments.apps"),
    ("list", "configmaps"),
    ("create", "serviceaccounts/token"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
]
FORBIDDEN_CLUSTER: list[tuple[str, str]] = [
    ("patch", "nodes"),
    ("delete", "nodes"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("impersonate", "users"),
]


@pytest.mark.parametrize(("verb", "resource"), NEEDED, ids=[f"{v}-{r}" for v, r in NEEDED])
def test_operator_sa_may(kubectl: Kubectl, chart_rbac: ChartRbac, verb: str, resource: str) -> None:
    assert can_i(kubectl, chart_rbac.user, NS, verb, resource)


@pytest.mark.parametrize(
    ("verb", "resource"), NEEDED_CLUSTER, ids=[f"{v}-{r}" for v, r in NEEDED_CLUSTER]
)
def test_operator_sa_may_cluster(
    kubectl: Kubectl, chart_rbac: ChartRbac, verb: str, resource: str
) -> None:
    assert can_i(kubectl, chart_rbac.user, "", verb, resource)


@pytest.mark.parametrize(("verb", "resource"), FORBIDDEN, ids=[f"{v}-{r}" for v, r in FORBIDDEN])
def test_operator_sa_may_not(
    kubectl: Kubectl, chart_rbac: ChartRbac, verb: str, resource: str
) -> None:
    assert not can_i(kubectl, chart_rbac.user, NS, verb, resource)


@pytest.mark.parametrize(
    ("verb", "resource"), FORBIDDEN_CLUSTER, ids=[f"{v}-{r}" for v, r in FORBIDDEN_CLUSTER]
)
def test_operator_sa_may_not_cluster(
    kubectl: Kubectl, chart_rbac: ChartRbac, verb: str, resource: str
) -> None:
    assert not can_i(kubectl, chart_rbac.user, "", verb, resource)


def test_worker_sa_reads_only_its_modeldeployments(kubectl: Kubectl, chart_rbac: ChartRbac) -> None:
    user = f"system:serviceaccount:{NS}:{RELEASE}-worker"  # the chart's <release>-worker
    assert can_i(kubectl, user, NS, "get", "modeldeployments.weightlift.dev")
    assert can_i(kubectl, user, NS, "watch", "modeldeployments.weightlift.dev")
    for verb, resource in [
        ("list", "pods"),
        ("get", "secrets"),
        ("patch", "modeldeployments.weightlift.dev/status"),
        ("create", "pods"),
    ]:
        assert not can_i(kubectl, user, NS, verb, resource), f"worker may {verb} {resource}"


def test_operator_under_chart_rbac_never_forbidden(
    kubectl: Kubectl, chart_rbac: ChartRbac, operator: OperatorProcess
) -> None:
    """The real operator, authenticated as the chart's ServiceAccount, does a full cycle
    (create pods, patch status, delete) without a single 403."""
    md = {
        "apiVersion": "weightlift.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "rbac-cycle", "namespace": NS},
        "spec": {"model": {"uri": "file:///models/rbac"}, "replicas": 2,
                 "loading": {"waitForSourceSeconds": 0}},
    }  # fmt: skip
    seen = len(operator.log())  # only this test's traffic counts (other tests provoke errors)
    kubectl("apply", "-f", "-", input=json.dumps(md))

    def progressed() -> bool:
        got = json.loads(kubectl("get", "-n", NS, "md/rbac-cycle", "-o", "json").stdout)
        pods = json.loads(
            kubectl(
                "get", "pods", "-n", NS, "-l", "weightlift.dev/deployment=rbac-cycle", "-o", "json"
            ).stdout
        )["items"]
        return len(pods) == 2 and (got.get("status") or {}).get("replicas") == 2

    wait_for(progressed, 60, "operator to create 2 pods and write status")
    # kwok marks every readiness gate True when it runs a pod; these replicas were never probed
    # (kwok pods answer nothing), so the operator sets each gate False: a pods/status patch.
    gate = "weightlift.dev/inference-probe"

    def gates() -> list[str]:
        pods = json.loads(
            kubectl(
                "get", "pods", "-n", NS, "-l", "weightlift.dev/deployment=rbac-cycle", "-o", "json"
            ).stdout
        )["items"]
        return [
            c["status"]
            for p in pods
            for c in p["status"].get("conditions", [])
            if c["type"] == gate
        ]

    wait_for(lambda: gates() == ["False", "False"], 60, "the operator to set both gates False")
    # ...and its Service (server-side apply), owned by the ModelDeployment.
    svc = json.loads(kubectl("get", "-n", NS, "svc/rbac-cycle", "-o", "json").stdout)
    assert svc["spec"]["selector"] == {
        "weightlift.dev/deployment": "rbac-cycle",
        "weightlift.dev/serving": "true",
    }
    assert svc["metadata"]["ownerReferences"][0]["name"] == "rbac-cycle"
    # No Event is due here: progress phases post none (planning.EVENT_PHASES), and this cycle
    # never reaches an outcome; it checks pods, status and deletion.
    kubectl("delete", "-n", NS, "md/rbac-cycle", "--timeout=60s")
    log = operator.log()[seen:]
    assert operator.alive()
    assert "rbac-cycle" in log
    for needle in ("Forbidden", " 403", "forbidden"):
        assert needle not in log, f"operator hit {needle!r}:\n{log[-3000:]}"
