"""The chart's ValidatingAdmissionPolicy for hostpath:// and file:// model URIs, rendered by the
real helm and enforced by the real API server. Each test binds its policy to its own namespace
only, so the rest of the session's tests are not affected."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from tests.integration.test_crd_live import dry_run, md
from tests.support.cluster import REPO, Kubectl, wait_for
from weightlift.local.cluster import tool_path

JSON = dict[str, Any]


def _policy_docs(release: str, *values: str) -> list[JSON]:
    out = subprocess.run(
        [
            str(tool_path("helm")), "template", release, str(REPO / "helm" / "weightlift"),
            "--namespace", "weightlift-system", "--show-only",
            "templates/model-path-policy.yaml", *values,
        ],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture
def policy(kubectl: Kubectl, crd: str, namespace: str) -> Iterator[Callable[..., None]]:
    applied: list[JSON] = []

    def install(release: str, *values: str) -> None:
        docs = _policy_docs(release, *values)
        for doc in docs:
            if doc["kind"] == "ValidatingAdmissionPolicyBinding":
                doc["spec"]["matchResources"] = {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                }
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        applied.extend(docs)
        # The API server compiles and starts enforcing a new policy within a few seconds.
        probe = md("policy-probe", model={"uri": "hostpath:///etc"})
        wait_for(lambda: dry_run(kubectl, namespace, probe)[0] != 0, 60, "the policy to enforce")

    yield install
    for doc in applied:
        kubectl("delete", doc["kind"], doc["metadata"]["name"], "--wait=false", check=False)


REFUSED_ANYWHERE = [
    "hostpath:///",
    "hostpath:///etc",
    "hostpath:///tmp/../etc",
    "hostpath:///../../etc",
    "file:///etc/passwd",
    "hostpath:///dev/null",
    "hostpath:///var/lib/weightlift/models-evil/x",
    "hostpath:////var/lib/weightlift/models/x",  # not normalised: not below the prefix as written
    "hostpath:///var/lib/weightlift/models/../../../etc",
]


ADMITTED = [
    "hostpath:///var/lib/weightlift/models/tiny",
    "hostpath:///data",
    "file:///data/llama/v1",
    "pvc://models/llama",  # not a local path: the policy does not apply
    "s3://bucket/llama",
]


def test_only_paths_below_the_allowed_prefixes_admitted(
    kubectl: Kubectl, namespace: str, policy: Callable[..., None]
) -> None:
    policy("wlp", "--set", "modelPathPrefixes={/var/lib/weightlift/models,/data}")
    for uri in REFUSED_ANYWHERE:
        code, out = dry_run(kubectl, namespace, md("outside", model={"uri": uri}))
        assert code != 0, f"admitted {uri}"
        assert "spec.model.uri" in out, out
    for uri in ADMITTED:
        code, out = dry_run(kubectl, namespace, md("inside", model={"uri": uri}))
        assert code == 0, f"{uri}: {out}"


def test_default_chart_refuses_every_local_path(
    kubectl: Kubectl, namespace: str, policy: Callable[..., None]
) -> None:
    policy("wle")
    for uri in ("hostpath:///var/lib/weightlift/models/tiny", "file:///models/tiny"):
        code, out = dry_run(kubectl, namespace, md("default", model={"uri": uri}))
        assert code != 0, f"admitted {uri} with no modelPathPrefixes"
        assert "none are; chart value modelPathPrefixes" in " ".join(out.split()), out
    code, out = dry_run(kubectl, namespace, md("pvc", model={"uri": "pvc://models/tiny"}))
    assert code == 0, out


def test_updates_are_checked_too(
    kubectl: Kubectl, namespace: str, policy: Callable[..., None]
) -> None:
    policy("wlp", "--set", "modelPathPrefixes={/data}")
    obj = md("moved", model={"uri": "hostpath:///data/tiny"})
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj))
    patch = json.dumps({"spec": {"model": {"uri": "hostpath:///etc"}}})
    proc = kubectl("patch", "-n", namespace, "md/moved", "--type=merge", "-p", patch, check=False)
    assert proc.returncode != 0 and "spec.model.uri" in proc.stderr, proc.stderr
