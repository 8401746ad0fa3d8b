"""Generate the ModelDeployment CRD from the pydantic models in model.py.

pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema:
no $ref, no anyOf-with-null (use nullable), no titles, every object typed. The translation is
small and explicit here rather than a dependency, because no maintained library targets
Kubernetes structural schemas.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from weightlift.api import limits
from weightlift.api.kubeschema import schema_of
from weightlift.api.labels import MAX_NAME_LENGTH, SELECTABLE_FIELDS
from weightlift.api.model import (
    COMPLETION_PROTOCOL_MESSAGE,
    DEFAULT_GPU_RESOURCE,
    GROUP,
    GROUP_SPARES_MESSAGE,
    INJECTED_WORKER_MESSAGE,
    KIND,
    PLURAL,
    PROBE_NEEDS_COMPLETION_MESSAGE,
    PROTOCOL_ENDPOINTS,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    WARM_SPARES_MESSAGE,
    WORKER_GPU_MESSAGE,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    gpu_count_message,
)
from weightlift.api.podspec import KUBERNETES_SCHEMA, WORKER_CONTAINER

_DROP_KEYS = {"title", "$defs", "discriminator"}
# How a map-key rule's message names the pattern it enforces.
_KEY_KINDS = {
    limits.QUALIFIED_NAME: "qualified names ([DNS-subdomain prefix/]name, the name at most 63 "
    "alphanumerics, '-', '_' or '.'; e.g. nvidia.com/gpu or kubernetes.io/hostname)",
}

# Rules the API server enforces at admission (CEL), each naming the field it guards.
_SPEC_VALIDATIONS = [
    {
        "rule": "!has(self.runtime) || self.runtime.type != 'External' "
        "|| (has(self.runtime.command) && size(self.runtime.command) > 0)",
        "message": "spec.runtime.command is required when spec.runtime.type is External",
        "fieldPath": ".runtime.command",
    },
    {
        "rule": "self.model.format != 'safetensors' "
        "|| (has(self.runtime) && (self.runtime.type == 'External' "
        "|| (has(self.runtime.engine) && self.runtime.engine in ['vLLM', 'Triton'])))",
        "message": "spec.model.format safetensors needs spec.runtime.engine vLLM or Triton, or "
        "spec.runtime.type External (the Builtin engine serves pt2 programs)",
        "fieldPath": ".model.format",
    },
    {
        "rule": "!has(self.runtime) || !has(self.runtime.engine) "
        "|| !(self.runtime.engine in ['vLLM', 'Triton']) "
        "|| (has(self.model.format) && self.model.format == 'safetensors')",
        "message": "spec.runtime.engine vLLM or Triton needs spec.model.format safetensors",
        "fieldPath": ".runtime.engine",
    },
    {
        "rule": "!has(self.runtime) || self.runtime.type != 'External' "
        "|| !has(self.runtime.engine) || self.runtime.engine == 'Builtin'",
        "message": "spec.runtime.engine applies to runtime.type Builtin, not External",
        "fieldPath": ".runtime.engine",
    },
    {
        "rule": "!has(self.warmSpares) || self.warmSpares == 0 "
        "|| ((!has(self.runtime) || !has(self.runtime.type) || self.runtime.type != 'External') "
        "&& (!has(self.loading) || !has(self.loading.strategy) "
        "|| self.loading.strategy in ['Auto', 'PeerToPeer']))",
        "message": WARM_SPARES_MESSAGE,
        "fieldPath": ".warmSpares",
    },
    {
        "rule": "!has(self.template) || !has(self.template.worker) "
        "|| self.template.worker != 'Injected' || (has(self.runtime) "
        "&& (!has(self.runtime.type) || self.runtime.type == 'Builtin') "
        "&& has(self.runtime.engine) && self.runtime.engine in ['vLLM', 'Triton'])",
        "message": INJECTED_WORKER_MESSAGE,
        "fieldPath": ".template.worker",
    },
    {
        "rule": "!has(self.warmSpares) || self.warmSpares == 0 || !has(self.parallelism) "
        "|| !has(self.parallelism.podsPerReplica) || self.parallelism.podsPerReplica == 1",
        "message": GROUP_SPARES_MESSAGE,
        "fieldPath": ".warmSpares",
    },
]


def _field_or(path: str, name: str, default: str) -> str:
    return f"(has({path}.{name}) ? {path}.{name} : {default})"


# The GPU count a pod requests is the operator's (pods.py); a template may name it only with
# the same count (ranks per pod), as pydantic's ModelDeploymentSpec checks it.
_GPU = _field_or("self.template", "gpuResource", f"'{DEFAULT_GPU_RESOURCE}'")
_PAR = "self.parallelism"
_RANKS_PER_POD = (
    f"(!has({_PAR}) ? 1 : {_field_or(_PAR, 'tensor', '1')} * {_field_or(_PAR, 'pipeline', '1')}"
    f" / {_field_or(_PAR, 'podsPerReplica', '1')})"
)
_GPU_COUNT_VALIDATIONS = [
    {
        "rule": f"!has(self.template) || !has(self.template.resources) "
        f"|| !has(self.template.resources.{part}) || !({_GPU} in self.template.resources.{part}) "
        f"|| self.template.resources.{part}[{_GPU}] == string({_RANKS_PER_POD})",
        "message": gpu_count_message(part),
        "fieldPath": f".template.resources.{part}",
    }
    for part in ("limits", "requests")
]
_GPU_COUNT_VALIDATIONS.append(
    {
        "rule": "!has(self.template) || !has(self.template.spec) "
        "|| !has(self.template.spec.containers) || self.template.spec.containers.all(c, "
        f"c.name != '{WORKER_CONTAINER}' || !has(c.resources) || ("
        + " && ".join(
            f"(!has(c.resources.{part}) || !({_GPU} in c.resources.{part}))"
            for part in ("limits", "requests")
        )
        + "))",
        "message": WORKER_GPU_MESSAGE,
        "fieldPath": ".template.spec.containers",
    }
)


def _cel_list(values: Any) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


# An External runtime's protocol bounds the probe (PROTOCOL_ENDPOINTS, as pydantic checks it):
# a server with no KServe v2 /infer needs a completion probe, of a protocol it answers.
_NO_INFER = _cel_list(p for p, e in PROTOCOL_ENDPOINTS.items() if not e.infer)
_COMPLETIONS = (
    "{"
    + ", ".join(f"'{p}': {_cel_list(e.completions)}" for p, e in PROTOCOL_ENDPOINTS.items())
    + "}"
)
_PROBE_VALIDATIONS = [
    {
        "rule": "!has(self.runtime) || !has(self.runtime.protocol) "
        f"|| !(self.runtime.protocol in {_NO_INFER}) "
        "|| (has(self.probe) && has(self.probe.completion))",
        "message": PROBE_NEEDS_COMPLETION_MESSAGE,
        "fieldPath": ".probe.completion",
    },
    {
        "rule": "!has(self.runtime) || !has(self.runtime.protocol) || !has(self.probe) "
        "|| !has(self.probe.completion) || !has(self.probe.completion.protocol) "
        f"|| self.probe.completion.protocol in {_COMPLETIONS}[self.runtime.protocol]",
        "message": COMPLETION_PROTOCOL_MESSAGE,
        "fieldPath": ".probe.completion.protocol",
    },
]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if KUBERNETES_SCHEMA in node:
        # A core/v1 type in the Kubernetes API's own schema, already structural.
        inlined = schema_of(node[KUBERNETES_SCHEMA])
        own = {k: v for k, v in node.items() if k not in (KUBERNETES_SCHEMA, "title")}
        rules = inlined.get("x-kubernetes-validations", []) + own.pop(
            "x-kubernetes-validations", []
        )
        return {**inlined, **own, **({"x-kubernetes-validations": rules} if rules else {})}
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)  # a field's own description/default wins over the def's
        return _resolve(target, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: _resolve(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _resolve(value, defs)
    return _structural(out)


def _map_keys(node: dict[str, Any]) -> None:
    """dict[Key, Value] with constrained keys: JSON Schema's patternProperties/propertyNames are
    not structural, so the value schema becomes additionalProperties and the key constraints a
    CEL rule over the map's keys."""
    keys: dict[str, Any] = dict(node.pop("propertyNames", None) or {})
    patterns = node.pop("patternProperties", None)
    if patterns:
        if len(patterns) != 1:
            raise ValueError(f"cannot express several key patterns structurally: {patterns}")
        ((pattern, value),) = patterns.items()
        node["additionalProperties"] = value
        keys["pattern"] = pattern
    checks, wants = [], []
    if "maxLength" in keys:
        checks.append(f"size(k) <= {keys['maxLength']}")
        wants.append(f"at most {keys['maxLength']} characters")
    if "pattern" in keys:
        checks.append(f"k.matches(r'{keys['pattern']}')")
        wants.append(_KEY_KINDS.get(keys["pattern"], f"matching {keys['pattern']}"))
    if checks:
        rule = {
            "rule": f"self.all(k, {' && '.join(checks)})",
            "message": "keys must be " + " and ".join(wants),
        }
        node.setdefault("x-kubernetes-validations", []).append(rule)


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the JSON-Schema-isms the API server rejects."""
    _map_keys(node)
    for combinator in ("anyOf", "oneOf"):
        options = node.get(combinator)
        if options is None:
            continue
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) == 1 and len(non_null) < len(options):
            merged = dict(non_null[0])
            merged.update({k: v for k, v in node.items() if k != combinator})
            merged["nullable"] = True
            if merged.get("default", ...) is None:
                merged.pop("default")
            return merged
        raise ValueError(f"cannot express {combinator} structurally: {options}")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("default", ...) is None:
        node.pop("default")
    if node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" in node:
        node.pop("additionalProperties")  # a free-form dict[str, Any]
        node.setdefault("type", "object")
    if node.get("type") == "object" and "additionalProperties" in node and "properties" in node:
        node.pop("additionalProperties")  # extra="forbid": the API server prunes unknown fields
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
    # Optional nested objects default to {} so the API server applies their inner defaults
    # (pydantic's default_factory leaves no trace in JSON Schema).
    required = set(node.get("required", []))
    for name, sub in node.get("properties", {}).items():
        if (
            name not in required
            and sub.get("type") == "object"
            and "properties" in sub
            and "default" not in sub
            and not sub.get("nullable")
        ):
            sub["default"] = {}
    return node


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    schema: dict[str, Any] = _resolve(raw, defs)
    return schema


def missing_descriptions(schema: dict[str, Any], path: str = "spec") -> list[str]:
    """Field paths without a description (kubectl explain would show nothing)."""
    missing: list[str] = []
    for name, sub in schema.get("properties", {}).items():
        here = f"{path}.{name}"
        if not sub.get("description"):
            missing.append(here)
        missing += missing_descriptions(sub, here)
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            missing += missing_descriptions(sub["items"], here + "[]")
    return missing


def unbounded(schema: dict[str, Any], path: str = "spec") -> list[str]:
    """Field paths of strings without maxLength (or enum), lists without maxItems and maps
    without maxProperties: what admission would let grow until etcd or a kubelet gives up.
    Free-form JSON (preserve-unknown-fields) counts as bounded only with maxProperties."""
    found: list[str] = []
    kind = schema.get("type")
    if kind is None and schema.get("x-kubernetes-preserve-unknown-fields"):
        # Any JSON value: bounded only by a CEL rule of the list or map holding it.
        return [] if schema.get("x-bounded-by-parent") else [path]
    if kind == "string" and "maxLength" not in schema and "enum" not in schema:
        found.append(path)
    checked = bool(schema.get("x-kubernetes-validations"))
    if kind == "array":
        if "maxItems" not in schema:
            found.append(path)
        found += unbounded(_mark(schema.get("items") or {}, checked), path + "[]")
    if kind == "object" and "properties" not in schema and "maxProperties" not in schema:
        found.append(path)
    for name, sub in schema.get("properties", {}).items():
        found += unbounded(sub, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        found += unbounded(_mark(schema["additionalProperties"], checked), path + "{}")
    return found


def _mark(schema: dict[str, Any], checked: bool) -> dict[str, Any]:
    return {**schema, "x-bounded-by-parent": True} if checked else schema


def build_crd() -> dict[str, Any]:
    spec_schema = openapi_schema(ModelDeploymentSpec)
    spec_schema["description"] = "Desired state: which model, how many replicas, how to load."
    spec_schema["x-kubernetes-validations"] = [
        *_SPEC_VALIDATIONS,
        *_PROBE_VALIDATIONS,
        *_GPU_COUNT_VALIDATIONS,
    ]
    status_schema = openapi_schema(ModelDeploymentStatus)
    status_schema["description"] = "Observed state, written by the operator."
    # The status is written only by the operator; keep unknown fields so an older CRD never
    # silently drops what a newer operator writes.
    status_schema["x-kubernetes-preserve-unknown-fields"] = True
    columns = [
        ("Phase", "string", ".status.phase", "Lifecycle phase"),
        ("Ready", "string", ".status.ready", "Replicas that passed inference probes / desired"),
        ("Sources", "integer", ".status.readySources", "Ready P2P sources"),
        ("Loaded", "string", ".status.loaded", "Percent of weight bytes loaded"),
        (
            "Pods/Replica",
            "integer",
            ".spec.parallelism.podsPerReplica",
            "Pods per replica (a LeaderWorkerSet group when more than 1)",
        ),
        ("Spares", "integer", ".status.spares", "Warm spares waiting in Standby"),
        ("Standby", "integer", ".status.standby", "Targets waiting in Standby for peers"),
        ("Identity", "string", ".status.modelIdentity", "Model identity hash"),
        ("Service", "string", ".status.service.name", "Service of the serving replicas"),
        ("Ports", "string", ".status.service.ports", "The Service's ports"),
    ]
    printer: list[dict[str, Any]] = [
        {"name": name, "type": typ, "jsonPath": path, "description": desc}
        for name, typ, path, desc in columns
    ]
    for column in printer[-4:]:
        column["priority"] = 1  # only with -o wide
    printer.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "weightlift"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all", "weightlift"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": printer,
                    "selectableFields": [{"jsonPath": path} for path in SELECTABLE_FIELDS],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A model served by GPU replicas that load weights "
                            "from storage or from each other, Ready only after inference probes.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                {
                                    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                                    "message": f"metadata.name: at most {MAX_NAME_LENGTH} "
                                    "characters (worker pod names and labels derive from it)",
                                }
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `weightlift crd` from api/model.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
