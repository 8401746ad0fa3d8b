"""spec.template's pod-template parts against the real API server: each operator-owned field
refused by the CRD's CEL rules naming the field, a full template stored as written, and
`kubectl explain` showing Kubernetes' own fields. ~15 s on a warm control plane."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.test_crd_live import dry_run, md
from tests.support.cluster import Kubectl, wait_for
from tests.support.podtemplates import FULL, FULL_CLASSES, OWNED


@pytest.mark.parametrize(
    ("template", "named"), [(t, n) for _, t, n in OWNED], ids=[i for i, _, _ in OWNED]
)
def test_operator_owned_field_refused_naming_it(
    crd: str, kubectl: Kubectl, namespace: str, template: dict[str, Any], named: str
) -> None:
    code, out = dry_run(kubectl, namespace, md("owned", template=template))
    assert code != 0, f"admitted: {template}"
    assert named in out, out


def test_an_unknown_pod_field_is_refused_naming_it(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    code, out = dry_run(kubectl, namespace, md("unknown", template={"spec": {"hostNetwork": True}}))
    assert code != 0 and "hostNetwork" in out, out


def test_a_full_template_is_admitted_and_stored_unchanged(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    obj = md("full", template=FULL)
    proc = kubectl("create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(obj))
    stored = json.loads(proc.stdout)["spec"]["template"]
    for key, value in FULL.items():
        assert stored[key] == value, f"{key}: stored {stored[key]!r}"


def test_an_old_template_gains_no_pod_template_parts(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    """Defaulting adds no metadata or spec to an existing manifest's template."""
    obj = md("old", template={"image": "registry.local/worker:1"})
    proc = kubectl("create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(obj))
    stored = json.loads(proc.stdout)["spec"]["template"]
    assert "spec" not in stored and "metadata" not in stored, stored


def test_explain_affinity_prints_the_upstream_fields(crd: str, kubectl: Kubectl) -> None:
    field = "modeldeployment.spec.template.spec.affinity"
    out = wait_for(
        lambda: kubectl("explain", field, check=False).stdout,
        60,
        f"kubectl explain to know {field}",
    )
    for name in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        assert name in out, out
    assert "pod affinity scheduling rules" in out, out
    deep = kubectl(
        "explain",
        f"{field}.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution.podAffinityTerm",
    ).stdout
    assert "topologyKey" in deep and "labelSelector" in deep, deep


def test_the_merged_worker_pod_is_a_valid_pod(crd: str, kubectl: Kubectl, namespace: str) -> None:
    """render_pod with the full template, created (server dry run) as the operator would: the
    API server's own Pod validation and admission (Priority, RuntimeClass) take it whole."""
    from weightlift.api.model import ModelDeploymentSpec, Role
    from weightlift.operator.identity import model_identity
    from weightlift.operator.planning import DesiredPod, pod_name
    from weightlift.operator.pods import render_pod

    spec = ModelDeploymentSpec.model_validate(
        {"model": {"uri": "file:///models/tiny"}, "template": FULL}
    )
    identity = model_identity(spec)
    desired = DesiredPod(pod_name("full", identity, 0), 0, Role.SOURCE, identity, [])
    pod = render_pod("full", namespace, "0b7e6a52-5d0c-4f8e-9d7c-3e2a1f000001", spec, desired)
    pod["metadata"].pop("ownerReferences")  # no such owner here
    for obj in FULL_CLASSES:
        kubectl("apply", "-f", "-", input=json.dumps(obj))
    proc = kubectl(
        "create",
        "-n",
        namespace,
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(pod),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    created = json.loads(proc.stdout)
    assert created["spec"]["priority"] == 1000
    assert created["spec"]["affinity"] == FULL["spec"]["affinity"]
    assert created["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert [c["name"] for c in created["spec"]["containers"]] == ["worker", "log-shipper"]
    assert created["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov-rail0"
    worker = created["spec"]["containers"][0]
    assert worker["resources"]["limits"]["rdma/rail1"] == "1"
    assert worker["volumeMounts"][-1]["mountPath"] == "/licenses"
