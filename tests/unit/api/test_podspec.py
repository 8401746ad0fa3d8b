"""spec.template's pod-template parts: the vendored Kubernetes schema inlined structurally,
the operator-owned fields refused (pydantic mirror of the CRD's CEL rules). ~2 s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.podtemplates import FULL, OWNED
from weightlift.api import kubeschema, podspec
from weightlift.api.crd import build_crd
from weightlift.api.model import ModelDeploymentSpec

SPEC = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
TEMPLATE = SPEC["properties"]["template"]
POD = TEMPLATE["properties"]["spec"]


def spec_with(template: dict[str, Any]) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(
        {"model": {"uri": "hostpath:///models/llama"}, "template": template}
    )


def test_the_vendored_schema_says_where_it_came_from() -> None:
    data = kubeschema.vendored()
    assert data["kubernetesVersion"].startswith("v1.")
    assert "/openapi/v3/api/v1" in data["source"]
    assert all(name in data["definitions"] for name in data["roots"])


def test_affinity_is_upstreams_own_schema() -> None:
    affinity = POD["properties"]["affinity"]
    assert set(affinity["properties"]) == {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    term = affinity["properties"]["podAntiAffinity"]["properties"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]["items"]
    assert term["required"] == ["weight", "podAffinityTerm"]
    assert "topologyKey" in term["properties"]["podAffinityTerm"]["properties"]
    assert "pod affinity scheduling rules" in affinity["properties"]["podAffinity"]["description"]


def test_inlined_types_are_structural_and_bounded() -> None:
    text = json.dumps(POD)
    for word in ('"$ref"', '"allOf"', '"oneOf"', '"anyOf"', '"default"'):
        assert word not in text, word
    limits = POD["properties"]["containers"]["items"]["properties"]["resources"]["properties"][
        "limits"
    ]
    assert limits["additionalProperties"] == {"x-kubernetes-int-or-string": True}
    assert limits["maxProperties"] == kubeschema.PROPERTIES_MAX
    volume = POD["properties"]["volumes"]["items"]["properties"]
    assert "persistentVolumeClaim" in volume and "csi" in volume
    assert "rbd" not in volume and "gitRepo" not in volume  # deprecated upstream


def test_owned_container_fields_are_every_upstream_field_but_the_overrides() -> None:
    owned = podspec.worker_owned_fields()
    assert {"command", "args", "image", "ports", "readinessProbe", "lifecycle"} <= set(owned)
    assert not set(owned) & set(podspec.WORKER_OVERRIDES)


def test_the_crd_carries_a_rule_per_refusal() -> None:
    item_rules = POD["properties"]["containers"]["items"]["x-kubernetes-validations"]
    paths = {r.get("fieldPath") for r in item_rules}
    assert {".command", ".image", ".env", ".volumeMounts"} <= paths
    assert POD["properties"]["containers"]["x-kubernetes-list-map-keys"] == ["name"]
    assert POD["properties"]["volumes"]["items"]["x-kubernetes-validations"]


def test_crd_size_is_measured() -> None:
    size = len(json.dumps(build_crd(), separators=(",", ":")))
    print(f"CRD: {size} bytes of JSON")
    # Under 256 KiB: client-side `kubectl apply` stores the whole object in an annotation.
    assert size < 256 * 1024


def test_a_full_template_is_accepted_and_round_trips() -> None:
    spec = spec_with(FULL)
    assert spec.template.wire() == {**spec.template.wire(), **FULL}
    assert spec.template.spec is not None
    assert spec.template.spec.wire()["containers"][1]["name"] == "log-shipper"


def test_old_templates_keep_their_shape() -> None:
    spec = spec_with({"image": "r/w:1", "env": [{"name": "A", "value": "b"}]})
    assert spec.template.metadata is None and spec.template.spec is None
    assert "spec" not in spec.template.wire() and "metadata" not in spec.template.wire()


@pytest.mark.parametrize(
    ("template", "named"), [(t, n) for _, t, n in OWNED], ids=[i for i, _, _ in OWNED]
)
def test_operator_owned_fields_are_refused_naming_the_field(
    template: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValidationError, match=named.replace("[", r"\[").replace("]", r"\]")):
        spec_with(template)


def test_an_unknown_field_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="hostNetwork"):
        spec_with({"spec": {"hostNetwork": True}})


def test_sidecars_may_have_their_own_command_and_probes() -> None:
    spec = spec_with(
        {
            "spec": {
                "containers": [
                    {
                        "name": "x",
                        "image": "b:1",
                        "command": ["sh"],
                        "livenessProbe": {"exec": {"command": ["true"]}},
                    }
                ]
            }
        }
    )
    assert spec.template.spec is not None and spec.template.spec.containers[0]["command"]
