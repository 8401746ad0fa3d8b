"""The chart as one of several releases in a cluster, and as something `helm upgrade` keeps
current: per-release names for cluster-scoped objects, the CRD as a template that one release
manages, pull secrets, the Kubernetes version it needs. Rendered by the real helm binary."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.operator.test_chart import CHART, by_kind
from weightlift.local.cluster import tool_path

JSON = dict[str, Any]
# Kinds without a namespace; any other object the chart renders must name its namespace.
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "CustomResourceDefinition",
}


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return tool_path("helm")
    except Exception as exc:  # the tools are installed by `make test` (make tools)
        pytest.fail(f"helm is not installed ({exc}); run `make tools`")


def render(helm: Path, release: str, namespace: str, *args: str) -> list[JSON]:
    out = subprocess.run(
        [str(helm), "template", release, str(CHART), "-n", namespace, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def keys(docs: list[JSON]) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of each object; namespace "" for cluster-scoped ones."""
    out = set()
    for doc in docs:
        namespace = doc["metadata"].get("namespace", "")
        assert bool(namespace) != (doc["kind"] in CLUSTER_SCOPED), (doc["kind"], namespace)
        out.add((doc["kind"], namespace, doc["metadata"]["name"]))
    return out


def test_two_releases_of_one_name_in_two_namespaces_share_only_the_crd(helm: Path) -> None:
    """The likely case: both called "weightlift", in their own namespaces, watching their own;
    the second without the CRD. Nothing collides."""
    policy = ("--set", "networkPolicy.enabled=true")
    a = keys(render(helm, "weightlift", "team-a", "--set", "watchNamespaces={a1}", *policy))
    b_args = ("--set", "watchNamespaces={b1}", "--set", "crds.install=false", *policy)
    b = keys(render(helm, "weightlift", "team-b", *b_args))
    assert a & b == set(), "objects both releases would own"
    cluster_a = {name for kind, ns, name in a if not ns and kind != "CustomResourceDefinition"}
    assert cluster_a and all(n.startswith("team-a-weightlift-") for n in cluster_a), cluster_a
    assert ("CustomResourceDefinition", "", "modeldeployments.weightlift.dev") in a
    assert not [k for k in b if k[0] == "CustomResourceDefinition"]
    assert ("ServiceAccount", "a1", "weightlift-worker") in a, "the default release's name"


def test_two_releases_may_share_a_worker_namespace(helm: Path) -> None:
    """Worker objects are the release's: two releases of other names that put workers in one
    namespace (workerNamespaces) own apart objects there."""
    common = ("--set", "workerNamespaces={shared}", "--set", "networkPolicy.enabled=true")
    a = keys(render(helm, "a", "team-a", "--set", "watchNamespaces={a1}", *common))
    b = keys(render(helm, "b", "team-b", "--set", "watchNamespaces={b1}", *common))
    assert a & b == {("CustomResourceDefinition", "", "modeldeployments.weightlift.dev")}
    assert {("Role", "shared", "a-worker"), ("Role", "shared", "b-worker")} <= a | b


def test_worker_objects_are_named_after_the_release(helm: Path) -> None:
    docs = render(helm, "ml", "ops", "--set", "watchNamespaces={models}")
    workers = {
        (d["kind"], d["metadata"]["name"])
        for d in docs
        if d["metadata"].get("namespace") == "models"
    }
    assert {("ServiceAccount", "ml-worker"), ("Role", "ml-worker")} <= workers
    (binding,) = [d for d in by_kind(docs, "RoleBinding") if d["metadata"]["name"] == "ml-worker"]
    assert binding["roleRef"]["name"] == "ml-worker"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ml-worker", "namespace": "models"}
    ]


def test_the_crd_is_a_kept_template_only_where_crds_install(helm: Path) -> None:
    (crd,) = by_kind(render(helm, "wl", "ops"), "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/instance"] == "wl"
    (unkept,) = by_kind(
        render(helm, "wl", "ops", "--set", "crds.keep=false"), "CustomResourceDefinition"
    )
    assert "annotations" not in unkept["metadata"]
    assert not by_kind(
        render(helm, "wl", "ops", "--set", "crds.install=false"), "CustomResourceDefinition"
    )
    assert not (CHART / "crds").exists(), "crds/ is installed once and never upgraded by helm"


def test_the_admission_policy_binds_only_the_watched_namespaces(helm: Path) -> None:
    (binding,) = by_kind(
        render(helm, "wl", "ops", "--set", "watchNamespaces={m1,m2}"),
        "ValidatingAdmissionPolicyBinding",
    )
    assert binding["spec"]["matchResources"] == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["m1", "m2"]}
            ]
        }
    }
    (everywhere,) = by_kind(render(helm, "wl", "ops"), "ValidatingAdmissionPolicyBinding")
    assert "matchResources" not in everywhere["spec"], "cluster-wide: every namespace"


def test_the_watch_scope_is_annotated_for_other_releases(helm: Path) -> None:
    def scope(*args: str) -> str:
        (binding,) = by_kind(render(helm, "wl", "ops", *args), "ClusterRoleBinding")[:1]
        assert binding["metadata"]["name"] == "ops-wl-operator-cluster"
        return str(binding["metadata"]["annotations"]["weightlift.dev/watch-namespaces"])

    assert scope() == "*"
    assert scope("--set", "watchNamespaces={m1,m2}") == "m1,m2"


def test_pull_secrets_for_the_operator_and_its_workers(helm: Path) -> None:
    docs = render(
        helm,
        "wl",
        "ops",
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--set",
        "workerImagePullSecrets[0].name=wreg",
        "--set",
        "workerImagePullSecrets[1].name=mirror",
    )
    for kind in ("Deployment", "DaemonSet"):
        (workload,) = by_kind(docs, kind)
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--worker-image-pull")] == [
        "--worker-image-pull-secret=wreg",
        "--worker-image-pull-secret=mirror",
    ]
    (plain,) = by_kind(render(helm, "wl", "ops"), "Deployment")
    assert "imagePullSecrets" not in plain["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("imagePullSecrets[0].name=Not_A_Name", "/imagePullSecrets/0/name"),
        ("workerImagePullSecrets[0]=regcred", "/workerImagePullSecrets/0"),
        ("crds.instal=false", "/crds"),
    ],
)
def test_values_schema_checks_the_new_keys(helm: Path, setting: str, key: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", setting], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert f"at '{key}'" in result.stderr, result.stderr


def test_kubernetes_older_than_1_30_is_refused(helm: Path) -> None:
    """The admission policy is admissionregistration.k8s.io/v1 (GA in 1.30)."""
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.30.0-0"
    old = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--kube-version", "1.29.9"],
        capture_output=True,
        text=True,
    )
    assert old.returncode != 0 and "kubeVersion" in old.stderr, old.stderr
    assert render(helm, "wl", "ops", "--kube-version", "1.30.0-eks-1")
