"""The Kubernetes API's own schemas for the pod types spec.template embeds, as structural CRD
schemas: `kubectl explain modeldeployment.spec.template.spec.affinity` shows upstream's fields.

data/core-v1-pod-openapi.json is vendored from a real kube-apiserver's /openapi/v3/api/v1
(hack/fetch_pod_openapi.py records the version). Inlining it makes it structural: no $ref or
allOf, int-or-string for Quantity and IntOrString, no deprecated fields, no upstream defaults
(admission must store the template as written) or list-merge hints, and a bound on every
string, list and map (CEL's cost estimate and etcd's object size need them; upstream leaves
them to Go validation).
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

CORE = "io.k8s.api.core.v1."
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# Schema keywords dropped: defaults (upstream's would be stored into the template), patch and
# list-merge hints (list-map keys must be required or defaulted in a CRD), and union markers.
_DROP = {
    "default",
    "x-kubernetes-patch-strategy",
    "x-kubernetes-patch-merge-key",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-unions",
}
_MORE_INFO = re.compile(r"\s*More info: \S+")
# Bounds where upstream has none (its Go validation and etcd's object size bound them).
STRING_MAX = 4096
ITEMS_MAX = 64
PROPERTIES_MAX = 64
# An ephemeral volume's claim template carries metadata: its labels and annotations only.
_META_MAP = {
    "type": "object",
    "maxProperties": PROPERTIES_MAX,
    "additionalProperties": {"type": "string", "maxLength": STRING_MAX},
}
_SMALL_META = {
    "type": "object",
    "description": "Labels and annotations of the generated object.",
    "properties": {
        "labels": {**_META_MAP, "description": "Labels of the generated object."},
        "annotations": {**_META_MAP, "description": "Annotations of the generated object."},
    },
}


@cache
def vendored() -> dict[str, Any]:
    text = resources.files("weightlift.api").joinpath("data/core-v1-pod-openapi.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def kubernetes_version() -> str:
    return str(vendored()["kubernetesVersion"])


def schema_of(kind: str) -> dict[str, Any]:
    """The structural schema of core/v1 `kind` (e.g. "Affinity"), every reference inlined."""
    return _inline({"$ref": CORE + kind})


def _ref_name(node: dict[str, Any]) -> str | None:
    if "$ref" in node:
        return str(node["$ref"]).rsplit("/", 1)[-1]
    options = node.get("allOf")
    if isinstance(options, list) and len(options) == 1 and "$ref" in options[0]:
        return str(options[0]["$ref"]).rsplit("/", 1)[-1]
    return None


def _inline(node: dict[str, Any]) -> dict[str, Any]:
    name = _ref_name(node)
    if name is not None:
        own = {k: v for k, v in node.items() if k not in ("$ref", "allOf") and k not in _DROP}
        target: dict[str, Any]
        if name == OBJECT_META:
            target = dict(_SMALL_META)
        elif name in (QUANTITY, INT_OR_STRING):
            target = {"x-kubernetes-int-or-string": True}
        else:
            target = _inline(vendored()["definitions"][name])
        definition = vendored()["definitions"].get(name, {})
        # Quantity's and IntOrString's own descriptions are long and say nothing of the field.
        if (
            "description" not in own
            and "description" in definition
            and name
            not in (
                QUANTITY,
                INT_OR_STRING,
            )
        ):
            own["description"] = summary(definition["description"])
        if "description" in own:
            own["description"] = summary(own["description"])
        return {**target, **own}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "description":
            out[key] = summary(value)
        elif key == "properties":
            out[key] = {prop: _inline(sub) for prop, sub in value.items() if not _deprecated(sub)}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _inline(value)
        else:
            out[key] = value
    return _bounded(out)


def summary(description: str) -> str:
    """A description's first paragraph without its "More info" link: what `kubectl explain`
    needs (upstream's API reference has the rest). Keeps the CRD under 256 KiB of JSON, so a
    client-side `kubectl apply` (its last-applied annotation holds the whole object) still works."""
    first = description.split("\n\n")[0]
    return _MORE_INFO.sub("", first).strip()


def _deprecated(node: dict[str, Any]) -> bool:
    """Fields upstream deprecates (the in-tree volume plugins, gitRepo...): left out, so the
    CRD stays small and a template cannot start on what Kubernetes is removing."""
    return "deprecated" in str(node.get("description", "")).lower()


def _bounded(node: dict[str, Any]) -> dict[str, Any]:
    kind = node.get("type")
    if kind == "string" and "enum" not in node:
        node.setdefault("maxLength", STRING_MAX)
    elif kind == "array":
        node.setdefault("maxItems", ITEMS_MAX)
    elif kind == "object" and "properties" not in node:
        node.setdefault("maxProperties", PROPERTIES_MAX)
    return node


def quantities_as_strings(value: Any, kind: str) -> Any:
    """`value` (a core/v1 `kind`) with every Quantity written as a string: the API server takes
    `cpu: 1`, the kubernetes client's typed models refuse it. A copy; the rest unchanged."""
    return _quantities(value, {"$ref": CORE + kind})


def _quantities(value: Any, schema: dict[str, Any]) -> Any:
    name = _ref_name(schema)
    if name == QUANTITY:
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        return str(value) if is_number else value
    if name is not None:
        return _quantities(value, vendored()["definitions"].get(name, {}))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {
            k: _quantities(v, props[k] if k in props else extra if isinstance(extra, dict) else {})
            for k, v in value.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_quantities(v, schema["items"]) for v in value]
    return value
