"""The generated CRD: in sync with the pydantic model, structural, documented, bounded; and the
pydantic model rejects the same bad specs the API server would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from weightlift.api import limits
from weightlift.api.crd import (
    build_crd,
    missing_descriptions,
    openapi_schema,
    render_crd,
    unbounded,
)
from weightlift.api.model import (
    PARALLELISM_MESSAGE,
    WARM_SPARES_MESSAGE,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
)

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = [
    ROOT / "crds" / "modeldeployment.yaml",
    ROOT / "helm/weightlift/files/crds/modeldeployment.yaml",
]
HINT = "the committed CRD is stale: run `make crd` (weightlift crd > crds/modeldeployment.yaml)"

CRD = build_crd()
VERSION = CRD["spec"]["versions"][0]
ROOT_SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = ROOT_SCHEMA["properties"]["spec"]
STATUS = ROOT_SCHEMA["properties"]["status"]

FORBIDDEN_KEYS = {"$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "const", "title"}


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path."""
    out: list[tuple[str, dict[str, Any]]] = []
    if not isinstance(node, dict):
        return out
    out.append((path, node))
    for name, sub in node.get("properties", {}).items():
        out += walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += walk(node["additionalProperties"], f"{path}{{}}")
    return out


def keys_anywhere(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = set(node)
        for value in node.values():
            found |= keys_anywhere(value)
        return found
    if isinstance(node, list):
        found = set()
        for value in node:
            found |= keys_anywhere(value)
        return found
    return set()


def field(path: str) -> dict[str, Any]:
    node = SPEC
    for part in path.split("."):
        node = node["properties"][part]
    return node


# ------------------------------------------------------------------------------ in sync


@pytest.mark.parametrize("path", COMMITTED, ids=["crds", "helm"])
def test_committed_crd_matches_the_generator(path: Path) -> None:
    assert path.exists(), HINT
    assert path.read_text() == render_crd(), HINT


def test_render_is_the_same_in_every_interpreter_and_parses_back() -> None:
    """`weightlift crd` in fresh interpreters with other hash seeds (so an order taken from a
    set or a hash shows) prints byte for byte what this process renders and what is committed,
    and both parse back to the CRD."""
    ours = render_crd()
    for seed in ("0", "1", "4242"):
        done = subprocess.run(
            [sys.executable, "-m", "weightlift", "crd"],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == ours, f"PYTHONHASHSEED={seed}: the rendered CRD differs"
    assert [path.read_text() for path in COMMITTED] == [ours, ours], HINT
    assert yaml.safe_load(ours) == CRD
    assert yaml.safe_load(COMMITTED[0].read_text())["spec"]["names"]["kind"] == "ModelDeployment"


def test_check_crds_script_agrees() -> None:
    script = ROOT / "hack" / "check-crds"
    assert script.exists() and script.stat().st_mode & 0o111, "hack/check-crds is executable"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_crds_script_fails_on_drift(tmp_path: Path) -> None:
    stale = tmp_path / "crds" / "modeldeployment.yaml"
    stale.parent.mkdir()
    stale.write_text(render_crd().replace("Number of model replicas.", "Stale."))
    helm = tmp_path / "helm" / "weightlift" / "files" / "crds" / "modeldeployment.yaml"
    helm.parent.mkdir(parents=True)
    helm.write_text(render_crd())
    done = subprocess.run(
        [str(ROOT / "hack" / "check-crds"), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "make crd" in done.stderr + done.stdout


# --------------------------------------------------------------------------- structural


def test_no_json_schema_constructs_the_api_server_rejects() -> None:
    assert not keys_anywhere(ROOT_SCHEMA) & FORBIDDEN_KEYS


def test_every_node_is_typed() -> None:
    for path, node in walk(ROOT_SCHEMA):
        if node.get("x-kubernetes-int-or-string"):
            continue
        if node == {"x-kubernetes-preserve-unknown-fields": True}:
            continue  # any JSON value, checked by its parent's CEL rule
        assert "type" in node, f"{path or '<root>'} has no type"
        if "properties" in node or "additionalProperties" in node:
            assert node["type"] == "object", path
        if node["type"] == "array":
            assert isinstance(node.get("items"), dict), f"{path} array without items schema"
        assert not ("properties" in node and "additionalProperties" in node), path


def test_maps_are_typed_maps_with_checked_keys() -> None:
    selector = field("template.nodeSelector")
    assert selector["type"] == "object"
    assert selector["additionalProperties"]["type"] == "string"
    assert selector["additionalProperties"]["maxLength"] == 63
    assert "patternProperties" not in selector and "propertyNames" not in selector
    [rule] = selector["x-kubernetes-validations"]
    assert rule["rule"].startswith("self.all(k, size(k) <= 317 && k.matches(")


def test_probe_request_is_a_typed_kserve_request() -> None:
    request = field("probe.request")
    assert request["type"] == "object"
    assert "x-kubernetes-preserve-unknown-fields" not in request
    assert set(request["properties"]) == {"id", "inputs", "outputs"}
    data = request["properties"]["inputs"]["items"]["properties"]["data"]
    assert data["items"] == {"type": "number"}


def test_every_spec_string_list_and_map_is_bounded() -> None:
    """Admission bounds everything: a field added without maxLength/maxItems fails here."""
    assert unbounded(SPEC) == []


def test_unbounded_finds_gaps() -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "e": {"type": "string", "enum": ["a"]},
            "l": {"type": "array", "maxItems": 2, "items": {"type": "string"}},
            "m": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 1}},
            "j": {
                "type": "array",
                "maxItems": 1,
                "items": {"x-kubernetes-preserve-unknown-fields": True},
            },
        },
    }
    assert unbounded(schema) == ["spec.s", "spec.l[]", "spec.m", "spec.j[]"]


def largest_json(schema: dict[str, Any]) -> int:
    """Bytes of the largest JSON value the schema admits (unescaped characters)."""
    kind = schema.get("type")
    if kind == "string":
        return schema.get("maxLength") or max(len(v) for v in schema["enum"]) + 2
    if kind in ("number", "integer"):
        return 24
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (largest_json(schema["items"]) + 1)
    if kind is None:  # a scalar checked by its parent's CEL rule
        return 24 + 64
    size = 2
    for name, sub in schema.get("properties", {}).items():
        size += len(name) + 4 + largest_json(sub)
    if "additionalProperties" in schema:
        value = largest_json(schema["additionalProperties"])
        size += schema["maxProperties"] * (317 + 4 + value)
    return size


def test_largest_admissible_spec_fits_a_configmap() -> None:
    """The worker plan (a subset of the spec) travels in a ConfigMap: at most 1 MiB. The pod
    template is not in the plan: its upstream pod types (api/kubeschema.py) are bounded for
    CEL's cost, and the whole object by the API server's request and etcd limits."""
    plan_part = {
        **SPEC,
        "properties": {k: v for k, v in SPEC["properties"].items() if k != "template"},
    }
    size = largest_json(plan_part)
    print(f"largest admissible spec: {size} bytes")
    assert size < 1024 * 1024


def _valid(value: Any, schema: dict[str, Any], path: str) -> None:
    """A small structural validator: enough to prove defaults are valid for their schema."""
    kind = schema.get("type")
    if value is None:
        assert schema.get("nullable"), f"{path}: null default for non-nullable"
        return
    expected: dict[str, type | tuple[type, ...]] = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "boolean": bool,
        "number": (int, float),
    }
    if kind is not None:
        assert isinstance(value, expected[kind]), f"{path}: {value!r} is not {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if "minimum" in schema:
        assert value >= schema["minimum"], path
    if "maximum" in schema:
        assert value <= schema["maximum"], path
    if kind == "object":
        for name in schema.get("required", []):
            assert name in value, f"{path}: default lacks required {name}"
        for name, sub in value.items():
            if name in schema.get("properties", {}):
                _valid(sub, schema["properties"][name], f"{path}.{name}")


def test_defaults_are_valid_for_their_schema() -> None:
    seen = 0
    for path, node in walk(SPEC, "spec"):
        if "default" in node:
            seen += 1
            _valid(node["default"], node, path)
    assert seen > 20


def test_optional_objects_default_to_empty_so_inner_defaults_apply() -> None:
    for name in ("parallelism", "template", "loading", "runtime", "rollout"):
        assert field(name)["default"] == {}, name
    assert "default" not in field("probe") and field("probe").get("nullable")
    assert "default" not in field("initHooks")


def test_spec_and_model_uri_are_required() -> None:
    assert ROOT_SCHEMA["required"] == ["spec"]
    assert SPEC["required"] == ["model"]
    assert "uri" in field("model")["required"]


# ------------------------------------------------------------------------ documentation


def test_every_spec_field_has_a_description() -> None:
    assert missing_descriptions(SPEC) == []
    assert SPEC["description"]


def test_missing_descriptions_finds_gaps() -> None:
    schema = {
        "properties": {
            "a": {"type": "string"},
            "b": {
                "type": "array",
                "description": "x",
                "items": {"properties": {"c": {"type": "string"}}},
            },
        }
    }
    assert missing_descriptions(schema) == ["spec.a", "spec.b[].c"]


def test_status_fields_have_descriptions_too() -> None:
    assert missing_descriptions(STATUS, "status") == []


# ------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [
        ("replicas", "minimum", 0),
        ("parallelism.tensor", "minimum", 1),
        ("loading.initialSources", "minimum", 1),
        ("loading.waitForSourceSeconds", "minimum", 0),
        ("rollout.maxSurge", "minimum", 1),
        ("runtime.port", "minimum", 1024),
        ("runtime.port", "maximum", 65535),
        ("probe.periodSeconds", "minimum", 1),
        ("warmSpares", "minimum", 0),
        ("warmSpares", "maximum", limits.WARM_SPARES_MAX),
    ],
)
def test_bounds(path: str, key: str, value: int) -> None:
    assert field(path)[key] == value


@pytest.mark.parametrize(
    ("path", "values"),
    [
        ("loading.strategy", ["Auto", "PeerToPeer", "Preload", "Direct"]),
        ("model.format", ["safetensors", "pt2"]),
        ("runtime.type", ["Builtin", "External"]),
        ("model.dtype", ["auto", "float32", "float16", "bfloat16"]),
        ("loading.peerToPeer.checksum", ["auto", "xxh3", "crc32", "dev64"]),
    ],
)
def test_enums(path: str, values: list[str]) -> None:
    assert sorted(field(path)["enum"]) == sorted(values)


def test_uri_pattern_lists_the_schemes() -> None:
    pattern = field("model.uri")["pattern"]
    for scheme in ("pvc", "hostpath", "file", "s3", "hf"):
        assert scheme in pattern


def test_defaults_match_the_pydantic_model() -> None:
    spec = ModelDeploymentSpec.model_validate({"model": {"uri": "pvc://m/x"}})
    assert field("replicas")["default"] == spec.replicas
    assert field("loading.strategy")["default"] == spec.loading.strategy
    assert field("loading.initialSources")["default"] == spec.loading.initial_sources
    assert field("loading.waitForSourceSeconds")["default"] == spec.loading.wait_for_source_seconds
    assert field("rollout.maxSurge")["default"] == spec.rollout.max_surge
    assert field("model.format")["default"] == spec.model.format
    assert field("loading.peerToPeer.checksum")["default"] == spec.loading.peer_to_peer.checksum


def test_cel_rules_name_their_field() -> None:
    rules = SPEC["x-kubernetes-validations"]
    assert rules
    for rule in rules:
        assert rule["message"].startswith("spec.")
        assert rule["fieldPath"].startswith(".")


# ------------------------------------------------------------------- names, subresources


def test_names_and_scope() -> None:
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "modeldeployments.weightlift.dev"
    assert CRD["spec"]["group"] == "weightlift.dev"
    assert CRD["spec"]["scope"] == "Namespaced"
    assert names["kind"] == "ModelDeployment"
    assert names["plural"] == "modeldeployments"
    assert names["shortNames"] == ["md", "mdep"]
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]


def test_status_and_scale_subresources_point_at_real_fields() -> None:
    subresources = VERSION["subresources"]
    assert subresources["status"] == {}
    scale = subresources["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert SPEC["properties"]["replicas"]["type"] == "integer"
    assert scale["statusReplicasPath"] == ".status.replicas"
    assert STATUS["properties"]["replicas"]["type"] == "integer"
    assert scale["labelSelectorPath"] == ".status.selector"
    assert STATUS["properties"]["selector"]["type"] == "string"


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert [c["name"] for c in VERSION["additionalPrinterColumns"] if c.get("priority", 0) == 0][
        :4
    ] == ["Phase", "Ready", "Sources", "Loaded"]
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    for name in ("Phase", "Ready", "Sources", "Loaded"):
        column = columns[name]
        leaf = column["jsonPath"].removeprefix(".status.")
        prop = STATUS["properties"][leaf]
        assert prop["type"] == column["type"], name
        assert column.get("description")
    assert columns["Sources"]["jsonPath"] == ".status.readySources"
    assert columns["Ready"]["jsonPath"] == ".status.ready"


def test_status_schema_matches_the_status_model() -> None:
    assert set(STATUS["properties"]) == set(openapi_schema(ModelDeploymentStatus)["properties"])
    for name in ("phase", "conditions", "observedGeneration", "sources", "replicaStatuses"):
        assert name in STATUS["properties"]


# ------------------------------------------------------------- pydantic rejects the same


GOOD: dict[str, Any] = {"model": {"uri": "pvc://models/llama"}}


def _with(path: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(yaml.safe_dump(GOOD))
    node = body
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return body


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("replicas", -1, "replicas"),
        ("parallelism.tensor", 0, "tensor"),
        ("model.uri", "ftp://host/model", "uri"),
        ("model.uri", "llama", "uri"),
        ("loading.strategy", "Fast", "strategy"),
        ("loading.initialSources", 0, "initialSources"),
        ("runtime.type", "External", "runtime.command"),
        ("template.shmSize", "lots", "shmSize"),
        ("surprise", True, "surprise"),
    ],
)
def test_pydantic_rejects_bad_specs_naming_the_field(path: str, value: Any, named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelDeploymentSpec.model_validate(_with(path, value))
    assert named in str(caught.value)


def test_external_runtime_with_command_is_accepted() -> None:
    body = _with("runtime", {"type": "External", "command": ["tritonserver"]})
    assert ModelDeploymentSpec.model_validate(body).runtime.command == ["tritonserver"]


def test_wire_form_round_trips_through_the_model() -> None:
    spec = ModelDeploymentSpec.model_validate(GOOD)
    wire = spec.wire()
    assert "initialSources" in wire["loading"]
    assert ModelDeploymentSpec.model_validate(wire) == spec


def test_pydantic_mirrors_the_cel_rule_for_safetensors() -> None:
    with pytest.raises(ValidationError) as caught:
        ModelDeploymentSpec.model_validate(_with("model.format", "safetensors"))
    assert "spec.model.format" in str(caught.value)
    body = _with("model.format", "safetensors")
    body["runtime"] = {"type": "External", "command": ["tritonserver"]}
    assert ModelDeploymentSpec.model_validate(body).model.format == "safetensors"


@pytest.mark.parametrize(
    "other",
    [
        {"loading": {"strategy": "Preload"}},
        {"loading": {"strategy": "Direct"}},
        {"runtime": {"type": "External", "command": ["tritonserver"]}},
    ],
)
def test_pydantic_mirrors_the_cel_rule_for_warm_spares(other: dict[str, Any]) -> None:
    """A spare waits in Standby to be handed peers: only a Target that may pull does."""
    with pytest.raises(ValidationError) as caught:
        ModelDeploymentSpec.model_validate({**GOOD, **other, "warmSpares": 1})
    assert "spec.warmSpares" in str(caught.value)
    assert ModelDeploymentSpec.model_validate({**GOOD, **other, "warmSpares": 0})
    rule = next(r for r in SPEC["x-kubernetes-validations"] if r["fieldPath"] == ".warmSpares")
    assert rule["message"] == WARM_SPARES_MESSAGE


def test_warm_spares_are_explained_and_shown() -> None:
    """`kubectl explain md.spec.warmSpares` says what a spare costs; `kubectl get md` shows the
    warm spares by default; the scale subresource's replicas are serving pods only."""
    text = field("warmSpares")["description"]
    assert "GPU pod" in text and "status.replicas" in text and "Standby" in text
    assert ModelDeploymentSpec.model_validate(GOOD).warm_spares == field("warmSpares")["default"]
    column = next(c for c in VERSION["additionalPrinterColumns"] if c["name"] == "Spares")
    assert column["jsonPath"] == ".status.spares" and column.get("priority", 0) == 0
    assert STATUS["properties"]["spares"]["type"] == column["type"] == "integer"
    assert "spares" in STATUS["properties"]["replicas"]["description"]


# -------------------------------------------------------------------------- parallelism


def test_parallelism_bounds_defaults_and_explain() -> None:
    """Defaults keep a replica one pod of tensor ranks; each field says it is identity."""
    spec = ModelDeploymentSpec.model_validate(GOOD)
    assert (spec.parallelism.pipeline, spec.parallelism.pods_per_replica) == (1, 1)
    for name, top in (
        ("tensor", limits.TENSOR_MAX),
        ("pipeline", limits.PIPELINE_MAX),
        ("podsPerReplica", limits.PODS_PER_REPLICA_MAX),
    ):
        node = field(f"parallelism.{name}")
        assert (node["type"], node["minimum"], node["maximum"], node["default"]) == (
            "integer",
            1,
            top,
            1,
        )
        assert "model identity" in node["description"]
    assert "podsPerReplica" in field("parallelism")["description"]


def test_parallelism_cel_rule_names_pods_per_replica() -> None:
    (rule,) = field("parallelism")["x-kubernetes-validations"]
    assert rule["fieldPath"] == ".podsPerReplica"
    assert rule["message"] == PARALLELISM_MESSAGE
    assert rule["message"].startswith("spec.parallelism.podsPerReplica")


@pytest.mark.parametrize(
    ("tensor", "pipeline", "pods", "ok"),
    [
        (1, 1, 1, True),
        (8, 1, 2, True),  # 4 ranks per pod
        (2, 2, 4, True),  # 1 rank per pod
        (4, 2, 2, True),
        (3, 1, 2, False),  # 1.5 ranks per pod
        (1, 1, 2, False),  # more pods than ranks
        (2, 3, 4, False),
    ],
)
def test_pydantic_mirrors_the_parallelism_rule(
    tensor: int, pipeline: int, pods: int, ok: bool
) -> None:
    body = {
        **GOOD,
        "parallelism": {"tensor": tensor, "pipeline": pipeline, "podsPerReplica": pods},
    }
    if ok:
        got = ModelDeploymentSpec.model_validate(body).parallelism
        assert got.ranks == tensor * pipeline == got.ranks_per_pod * pods
        return
    with pytest.raises(ValidationError) as caught:
        ModelDeploymentSpec.model_validate(body)
    assert "spec.parallelism.podsPerReplica" in str(caught.value)


def test_service_name_and_ports_show_with_wide_output() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    service = STATUS["properties"]["service"]["properties"]
    for name, leaf in (("Service", "name"), ("Ports", "ports")):
        column = columns[name]
        assert column["jsonPath"] == f".status.service.{leaf}"
        assert column["priority"] == 1  # kubectl get md -o wide
        assert service[leaf]["type"] == column["type"] == "string"


def test_service_is_on_by_default_with_its_defaults() -> None:
    spec = ModelDeploymentSpec.model_validate({"model": {"uri": "hostpath:///m"}})
    assert spec.service.enabled and spec.service.type == "ClusterIP" and spec.service.port == 80
    schema = SPEC["properties"]["service"]
    assert schema["default"] == {}
    assert schema["properties"]["type"]["enum"] == ["ClusterIP", "NodePort", "LoadBalancer"]
    assert schema["properties"]["port"]["default"] == 80
