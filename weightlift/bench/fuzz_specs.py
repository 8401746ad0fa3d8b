"""Generated ModelDeployments (valid and hostile) against the real API server and operator.

Specs are built from the CRD's own OpenAPI schema: a valid base spec, then up to four mutations,
each at a field path taken from the schema, with a value that fits the field (enum member, a
number in range, a string from its pattern) or breaks it (wrong type, out of range, too long,
off-pattern, too many items, a field the schema does not know, a reserved env name, a host path
outside the allowed prefixes, a required field removed). Each is created with
`fieldValidation=Strict`, as kubectl does. Counts: admitted, rejected with the field named in the
422 message, rejected without it (a vague refusal), API 5xx, and what the operator did with the
admitted ones: exceptions in its log, or the process dying.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

JSON = dict[str, Any]
# Admitted specs never reach a worker: no node carries this label.
FUZZ_SELECTOR = {"weightlift.io/fuzz-node": "none"}
HOSTILE_STRINGS = (
    "",
    "Bad Name!!",
    "../../etc",
    "/etc/passwd",
    "hostpath:///etc",
    "file:///etc/passwd",
    "a\x00b",
    "x" * 70_000,
    "$(reboot)",
    "\u202e\u0000",
)
RESERVED_ENV = ("WEIGHTLIFT_PLAN", "WEIGHTLIFT_BIND_HOST", "LD_PRELOAD", "LD_LIBRARY_PATH")
# spec.template's operator-owned pod fields (api/podspec.py), each a value admission refuses.
_WORKER = {"name": "worker"}
OWNED_TEMPLATE: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("template", "metadata", "labels"), {"weightlift.dev/role": "Source"}),
    (("template", "metadata", "annotations"), {"weightlift.dev/peers": "{}"}),
    (("template", "spec", "volumes"), [{"name": "plan", "emptyDir": {}}]),
    (("template", "spec", "volumes"), [{"name": "h", "hostPath": {"path": "/"}}]),
    (("template", "spec", "containers"), [{**_WORKER, "command": ["sh"]}]),
    (("template", "spec", "containers"), [{**_WORKER, "image": "evil:1"}]),
    (("template", "spec", "containers"), [{**_WORKER, "env": [{"name": "LD_PRELOAD"}]}]),
    (
        ("template", "spec", "containers"),
        [{**_WORKER, "volumeMounts": [{"name": "x", "mountPath": "/etc/weightlift/plan"}]}],
    ),
    (
        ("template", "spec", "containers"),
        [{"name": "s", "image": "b:1", "securityContext": {"privileged": True}}],
    ),
    (("template", "spec", "securityContext"), {"runAsUser": 0}),
)
# The pod template's upstream types hold most of the schema's fields: a mutation picks them
# or the rest with equal odds, so the ModelDeployment's own fields stay well fuzzed.
POD_TEMPLATE = ("template", "spec")


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]  # "[]" marks an array item
    schema: JSON


def leaves(schema: JSON, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every field of the schema a mutation can hit, arrays and objects included."""
    kind = schema.get("type")
    if path:
        yield Leaf(path, schema)
    if kind == "object":
        for key, sub in (schema.get("properties") or {}).items():
            yield from leaves(sub, (*path, key))
    elif kind == "array":
        yield from leaves(schema.get("items") or {}, (*path, "[]"))


def _valid(schema: JSON) -> st.SearchStrategy[Any]:
    kind = schema.get("type")
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if kind == "integer":
        lo = int(schema.get("minimum", 0))
        hi = min(int(schema.get("maximum", lo + 100)), lo + 3)  # few pods per admitted spec
        return st.integers(lo, hi)
    if kind == "number":
        return st.floats(schema.get("minimum", 0.0), schema.get("maximum", 1e6))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        limit = int(schema.get("maxLength", 64))
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda s: len(s) <= limit
            )
        return st.text(max_size=min(limit, 64))
    if kind == "array":
        return st.lists(_valid(schema.get("items") or {}), max_size=2)
    return st.just({})


def _invalid(schema: JSON) -> st.SearchStrategy[Any]:
    kind = schema.get("type")
    wrong_type = st.sampled_from(
        [v for v in (7, "seven", [1], {"a": 1}, True, 1.5) if _type_of(v) != kind]
    )
    options: list[st.SearchStrategy[Any]] = [wrong_type]
    if kind in ("integer", "number"):
        if "minimum" in schema:
            options.append(st.just(schema["minimum"] - 1))
        if "maximum" in schema:
            options.append(st.just(schema["maximum"] + 1))
    if kind == "string":
        if "maxLength" in schema:
            options.append(st.just("a" * (int(schema["maxLength"]) + 1)))
        if "pattern" in schema or "enum" in schema:
            options.append(st.sampled_from(HOSTILE_STRINGS))
    if kind == "array" and "maxItems" in schema:
        n = int(schema["maxItems"]) + 1
        options.append(st.just([_filler(schema.get("items") or {})] * n))
    if kind == "object" and "properties" in schema:
        options.append(st.just({"privileged": True}))
    return st.one_of(options)


def _type_of(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(v)]


def _filler(schema: JSON) -> Any:
    kind = schema.get("type")
    if kind == "string":
        return "a"
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "object":
        return {"name": "A", "value": "b"} if "value" in (schema.get("properties") or {}) else {}
    return "a"


@dataclass(frozen=True)
class Mutation:
    path: tuple[str, ...]
    value: Any
    valid: bool
    remove: bool = False

    @property
    def field_name(self) -> str:
        return next(p for p in reversed(self.path) if p != "[]")


def _set(spec: JSON, path: tuple[str, ...], value: Any, remove: bool) -> None:
    node: Any = spec
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if key == "[]":
            continue
        if not isinstance(node, dict):  # an earlier mutation put a scalar here
            return
        child = node.get(key)
        if nxt == "[]":
            deeper = bool(path[i + 2 :])
            if not isinstance(child, list) or not child:
                child = [{}] if deeper else [None]
                node[key] = child
            if deeper and not isinstance(child[0], dict):
                child[0] = {}
            node = child[0]
        else:
            if not isinstance(child, dict):
                child = {}
                node[key] = child
            node = child
    last = path[-1]
    if last == "[]":
        return
    if not isinstance(node, dict):
        return
    if remove:
        node.pop(last, None)
    else:
        node[last] = value


@st.composite
def mutation(draw: st.DrawFn, fields: list[Leaf], prefix: str) -> Mutation:
    kinds = ["valid", "invalid", "invalid", "env", "uri", "remove", "owned"]
    kind = draw(st.sampled_from(kinds))
    if kind == "owned":
        path, value = draw(st.sampled_from(OWNED_TEMPLATE))
        return Mutation(path, value, False)
    if kind == "env":
        name = draw(st.sampled_from(RESERVED_ENV))
        return Mutation(("template", "env"), [{"name": name, "value": "x"}], False)
    if kind == "uri":
        where = draw(st.sampled_from(["/", "/etc", "/tmp/../etc", f"{prefix}/../..", "/dev/null"]))
        scheme = draw(st.sampled_from(["hostpath://", "file://"]))
        return Mutation(("model", "uri"), scheme + where, False)
    if kind == "remove":
        return Mutation(("model", draw(st.sampled_from(["uri", "format"]))), None, False, True)
    pod = [f for f in fields if f.path[:2] == POD_TEMPLATE]
    rest = [f for f in fields if f.path[:2] != POD_TEMPLATE]
    leaf = draw(st.sampled_from(draw(st.sampled_from([g for g in (pod, rest) if g]))))
    if kind == "valid":
        return Mutation(leaf.path, draw(_valid(leaf.schema)), True)
    return Mutation(leaf.path, draw(_invalid(leaf.schema)), False)


def spec_schema() -> JSON:
    from weightlift.api.crd import build_crd

    crd = build_crd()
    schema: JSON = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def mutable_fields(schema: JSON) -> list[Leaf]:
    # The selector that keeps admitted specs off every node is not ours to fuzz.
    return [f for f in leaves(schema) if f.path[:2] != ("template", "nodeSelector")]


def base_spec(model_prefix: str) -> JSON:
    return {
        "model": {"uri": f"hostpath://{model_prefix}/model", "format": "pt2", "revision": "1"},
        "replicas": 1,
        "template": {"nodeSelector": dict(FUZZ_SELECTOR)},
    }


@st.composite
def specs(draw: st.DrawFn, fields: list[Leaf], model_prefix: str) -> tuple[JSON, list[Mutation]]:
    import copy

    spec = copy.deepcopy(base_spec(model_prefix))
    muts = draw(st.lists(mutation(fields, model_prefix), min_size=0, max_size=4))
    for m in muts:
        _set(spec, m.path, m.value, m.remove)
    spec.setdefault("template", {})
    if isinstance(spec["template"], dict):
        spec["template"]["nodeSelector"] = dict(FUZZ_SELECTOR)
    return spec, muts


@dataclass
class SpecCounts:
    cases: int = 0
    admitted: int = 0
    rejected_field_named: int = 0
    rejected_vague: int = 0
    api_5xx: int = 0
    other_status: int = 0
    operator_exceptions: int = 0
    operator_died: bool = False
    vague_examples: list[str] = field(default_factory=list)

    @property
    def crashes(self) -> int:
        return self.api_5xx + self.operator_exceptions + int(self.operator_died)


_FIELD_RE = re.compile(r"spec(\.[A-Za-z0-9_\[\]]+)+")


def names_a_field(message: str, muts: list[Mutation]) -> bool:
    """The 422 names a field: a `spec.<path>` in the message, or one of the mutated fields."""
    if _FIELD_RE.search(message):
        return True
    return any(m.field_name in message for m in muts)


OPERATOR_FAILURES = re.compile(r"Traceback|failed with an exception|Unhandled|RecursionError")


def operator_failures(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if OPERATOR_FAILURES.search(line)]


def settle(seconds: float) -> None:
    time.sleep(seconds)
