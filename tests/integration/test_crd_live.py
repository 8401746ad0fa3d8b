"""The generated CRD against a real API server: schema validation, subresources, examples."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import REPO, Kubectl, wait_for

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def md(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "weightlift.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"uri": "file:///models/tiny"}, "replicas": 1},
    }
    base["spec"].update(spec)
    return base


def dry_run(kubectl: Kubectl, ns: str, obj: dict[str, Any]) -> tuple[int, str]:
    proc = kubectl(
        "apply", "-n", ns, "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
    )
    return proc.returncode, proc.stderr + proc.stdout


def test_crd_established_and_explained(crd: str, kubectl: Kubectl) -> None:
    out = json.loads(kubectl("get", "crd", crd, "-o", "json").stdout)
    assert out["spec"]["group"] == "weightlift.dev"
    versions = {v["name"]: v for v in out["spec"]["versions"]}
    assert "scale" in versions["v1alpha1"]["subresources"]
    assert "status" in versions["v1alpha1"]["subresources"]
    # the published OpenAPI (what `kubectl explain` reads) follows the CRD within seconds
    explain = wait_for(
        lambda: kubectl("explain", "modeldeployment.spec.replicas", check=False).stdout,
        60,
        "kubectl explain to know modeldeployment.spec.replicas",
    )
    assert "Number of model replicas" in explain
    assert kubectl("get", "md", "-A", check=False).returncode == 0  # short name works


def test_parallelism_explained(crd: str, kubectl: Kubectl) -> None:
    """`kubectl explain` says how a replica's ranks spread over its pods."""
    explain = wait_for(
        lambda: (
            kubectl(
                "explain", "modeldeployment.spec.parallelism.podsPerReplica", check=False
            ).stdout
        ),
        60,
        "kubectl explain to know modeldeployment.spec.parallelism.podsPerReplica",
    )
    assert "Pods one replica spans" in explain and "tensor x pipeline" in explain, explain
    whole = kubectl("explain", "modeldeployment.spec.parallelism").stdout
    for name in ("tensor", "pipeline", "podsPerReplica"):
        assert name in whole, whole


def test_server_stores_the_committed_schema_unchanged(crd: str, kubectl: Kubectl) -> None:
    """What `weightlift crd` generated (and the chart ships) is what the API server enforces:
    nothing dropped or rewritten on the way in."""
    committed = yaml.safe_load((REPO / "crds" / "modeldeployment.yaml").read_text())
    assert committed["metadata"]["name"] == crd
    stored = json.loads(kubectl("get", "crd", crd, "-o", "json").stdout)
    want = {v["name"]: v["schema"]["openAPIV3Schema"] for v in committed["spec"]["versions"]}
    got = {v["name"]: v["schema"]["openAPIV3Schema"] for v in stored["spec"]["versions"]}
    assert got == want
    printer = [c["name"] for c in stored["spec"]["versions"][0].get("additionalPrinterColumns", [])]
    assert "Phase" in printer


def test_valid_spec_accepted(crd: str, kubectl: Kubectl, namespace: str) -> None:
    code, out = dry_run(kubectl, namespace, md("ok"))
    assert code == 0, out
    assert "created (server dry run)" in out


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("negative-replicas", {"replicas": -1}, "spec.replicas"),
    ("zero-tensor", {"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ("bad-scheme", {"model": {"uri": "ftp://x/y"}}, "spec.model.uri"),
    ("bad-strategy", {"loading": {"strategy": "Teleport"}}, "spec.loading.strategy"),
    ("bad-port", {"runtime": {"port": 80}}, "spec.runtime.port"),
    ("bad-dtype", {"model": {"uri": "file:///m", "dtype": "int3"}}, "spec.model.dtype"),
    (
        "negative-group-restarts",
        {"parallelism": {"maxGroupRestarts": -1}},
        "spec.parallelism.maxGroupRestarts",
    ),
]


def test_warm_spares_for_groups_are_refused_saying_why(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    spec = {"warmSpares": 1, "parallelism": {"tensor": 2, "podsPerReplica": 2}}
    code, out = dry_run(kubectl, namespace, md("groupspares", **spec))
    assert code != 0, "the API server admitted warm spares for multi-pod replicas"
    assert "spec.warmSpares needs spec.parallelism.podsPerReplica 1" in out, out
    one_pod = {"warmSpares": 1, "parallelism": {"tensor": 2}}
    code, out = dry_run(kubectl, namespace, md("podspares", **one_pod))
    assert code == 0, out


@pytest.mark.parametrize(("name", "spec", "field"), BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_schema_rejects_bad_spec_naming_field(
    crd: str, kubectl: Kubectl, namespace: str, name: str, spec: dict[str, Any], field: str
) -> None:
    code, out = dry_run(kubectl, namespace, md(name, **spec))
    assert code != 0, f"API server accepted a bad spec: {spec}"
    assert field in out, out
    assert "Invalid value" in out or "Unsupported value" in out, out


def test_schema_requires_model(crd: str, kubectl: Kubectl, namespace: str) -> None:
    obj = md("nomodel")
    del obj["spec"]["model"]
    code, out = dry_run(kubectl, namespace, obj)
    assert code != 0
    assert "spec.model" in out and "Required value" in out, out


def test_external_runtime_needs_command(crd: str, kubectl: Kubectl, namespace: str) -> None:
    code, out = dry_run(kubectl, namespace, md("ext", runtime={"type": "External"}))
    assert code != 0
    assert "spec.runtime.command is required" in out, out


def test_scale_subresource_and_status_isolation(crd: str, kubectl: Kubectl, namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(md("scaled")))
    kubectl("scale", "-n", namespace, "md/scaled", "--replicas=3")
    got = json.loads(kubectl("get", "-n", namespace, "md/scaled", "-o", "json").stdout)
    assert got["spec"]["replicas"] == 3
    scale = json.loads(
        kubectl(
            "get",
            "--raw",
            f"/apis/weightlift.dev/v1alpha1/namespaces/{namespace}/modeldeployments/scaled/scale",
        ).stdout
    )
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    # scale subresource validates against the schema's bounds too
    bad = kubectl("scale", "-n", namespace, "md/scaled", "--replicas=5000", check=False)
    assert bad.returncode != 0
    # status is a subresource: writes to the main resource do not touch it
    changed = copy.deepcopy(got)
    changed["status"] = {"phase": "Ready"}
    kubectl("replace", "-n", namespace, "-f", "-", input=json.dumps(changed))
    again = json.loads(kubectl("get", "-n", namespace, "md/scaled", "-o", "json").stdout)
    assert again.get("status", {}).get("phase") != "Ready"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_applies_cleanly(crd: str, kubectl: Kubectl, example: Path) -> None:
    """Applied exactly as a user would (`kubectl apply -f examples/x.yaml`), then removed."""
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    assert docs, f"{example.name} is empty"
    proc = kubectl("apply", "--dry-run=server", "-f", str(example), check=False)
    assert proc.returncode == 0, proc.stderr
    kubectl("apply", "-f", str(example))
    try:
        for doc in docs:
            if doc.get("kind") != "ModelDeployment":
                continue
            name = doc["metadata"]["name"]
            ns = doc["metadata"].get("namespace", "default")
            got = kubectl("get", "-n", ns, f"md/{name}", "-o", "json")
            stored = json.loads(got.stdout)
            # nothing was pruned: every field the example sets is stored as written
            _assert_subset(doc["spec"], stored["spec"], f"{example.name}: spec")
    finally:
        kubectl("delete", "-f", str(example), "--wait=false", check=False)


def _assert_subset(want: Any, got: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where} is {got!r}"
        for key, value in want.items():
            assert key in got, f"{where}.{key} was pruned by the API server"
            _assert_subset(value, got[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _assert_subset(w, g, f"{where}[{i}]")
    else:
        assert want == got, f"{where}: stored {got!r}, example says {want!r}"


def test_wide_output_shows_the_service_and_its_ports(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    """status.service as the operator writes it, in `kubectl get md -o wide` (the API server's
    table: the CRD's printer columns), and only there."""
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(md("served")))
    status = {
        "status": {"service": {"name": "served", "type": "ClusterIP", "ports": "http:80/TCP"}}
    }
    kubectl(
        "patch", "-n", namespace, "md/served", "--subresource=status", "--type=merge",
        "-p", json.dumps(status),
    )  # fmt: skip
    wide = kubectl("get", "-n", namespace, "md/served", "-o", "wide").stdout.splitlines()
    header, row = wide[0], wide[1]  # aligned columns; empty ones (no phase yet) are blank

    def cell(column: str) -> str:
        return row[header.index(column) :].split()[0]

    assert (cell("SERVICE"), cell("PORTS")) == ("served", "http:80/TCP"), wide
    narrow = kubectl("get", "-n", namespace, "md/served").stdout.splitlines()[0].split()
    assert "SERVICE" not in narrow and "PORTS" not in narrow
