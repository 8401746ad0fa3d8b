"""Hostile ModelDeployments (issue 13) against the real API server: each is refused at
admission, and the refusal names the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.test_crd_live import dry_run, md
from tests.support.cluster import Kubectl
from weightlift.api import limits
from weightlift.api.model import (
    COMPLETION_PROTOCOL_MESSAGE,
    PARALLELISM_MESSAGE,
    PROBE_NEEDS_COMPLETION_MESSAGE,
)


def _deep(depth: int) -> Any:
    value: Any = 1.0
    for _ in range(depth):
        value = [value]
    return value


def _infer(data: list[Any]) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(data)], "data": data}]}


def _template(**fields: Any) -> dict[str, Any]:
    return {"template": fields}


_COMPLETION: dict[str, Any] = {"prompt": "hello", "maxTokens": 4, "expectedPrefix": " world"}


def _external(probe: dict[str, Any] | None = None, **runtime: Any) -> dict[str, Any]:
    """An External runtime (runtime.protocol, its paths and port) and, if given, a probe."""
    spec: dict[str, Any] = {
        "runtime": {"type": "External", "command": ["vllm", "serve"], **runtime}
    }
    if probe is not None:
        spec["probe"] = probe
    return spec


MANY = 10_000

# (id, spec fields, text the API server's answer must contain: the field path)
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("uri-dotdot-root", {"model": {"uri": "hostpath:///../../etc"}}, "spec.model.uri"),
    ("uri-dotdot-inside", {"model": {"uri": "hostpath:///tmp/../etc"}}, "spec.model.uri"),
    ("pvc-dotdot", {"model": {"uri": "pvc://claim/../../etc"}}, "spec.model.uri"),
    (
        "library-dot-dotdot",
        {"initHooks": {"library": "hooks/./../hooks/libinit.so"}},
        "spec.initHooks.library",
    ),
    ("library-traversal", {"initHooks": {"library": "../../libevil.so"}}, "spec.initHooks.library"),
    (
        "library-absolute",
        {"initHooks": {"library": "/lib/x86_64-linux-gnu/libc.so.6"}},
        "spec.initHooks.library",
    ),
    (
        "env-plan",
        _template(env=[{"name": "WEIGHTLIFT_PLAN", "value": "{}"}]),
        "spec.template.env[0].name",
    ),
    (
        "env-bind-host",
        _template(env=[{"name": "OK", "value": "1"}, {"name": "WEIGHTLIFT_BIND_HOST"}]),
        "spec.template.env[1].name",
    ),
    (
        "env-ld-preload",
        _template(env=[{"name": "LD_PRELOAD", "value": "/tmp/evil.so"}]),
        "spec.template.env[0].name",
    ),
    (
        "env-nul",
        _template(env=[{"name": "A", "value": "x\u0000y"}]),
        "spec.template.env[0].value",
    ),
    (
        "env-many",
        _template(env=[{"name": f"V{i}", "value": "x"} for i in range(MANY)]),
        "spec.template.env",
    ),
    (
        "env-huge-value",
        _template(env=[{"name": "A", "value": "x" * (limits.ENV_VALUE_MAX + 1)}]),
        "spec.template.env[0].value",
    ),
    (
        "tolerations-many",
        _template(tolerations=[{"key": f"k{i}", "operator": "Exists"} for i in range(MANY)]),
        "spec.template.tolerations",
    ),
    (
        "toleration-bad-key",
        _template(tolerations=[{"key": "bad key!", "operator": "Exists"}]),
        "spec.template.tolerations[0].key",
    ),
    (
        "command-many",
        {"runtime": {"type": "External", "command": ["x"] * MANY}},
        "spec.runtime.command",
    ),
    ("image-huge", _template(image="a" * 1_000_000), "spec.template.image"),
    ("image-shell", _template(image="busybox; rm -rf /"), "spec.template.image"),
    ("image-subst", _template(image="worker:$(id)"), "spec.template.image"),
    (
        "service-account",
        _template(serviceAccountName="Bad Name!!"),
        "spec.template.serviceAccountName",
    ),
    ("node-selector-key", _template(nodeSelector={"bad key!": "x"}), "spec.template.nodeSelector"),
    (
        "node-selector-value",
        _template(nodeSelector={"gpu": "not a label value"}),
        "spec.template.nodeSelector.gpu",
    ),
    (
        "node-selector-many",
        _template(nodeSelector={f"k{i}": "v" for i in range(MANY)}),
        "spec.template.nodeSelector",
    ),
    (
        "cpu-lots",
        _template(resources={"requests": {"cpu": "lots"}}),
        "spec.template.resources.requests.cpu",
    ),
    (
        "resource-bad-name",
        _template(resources={"limits": {"not a resource": "1"}}),
        "spec.template.resources.limits",
    ),
    (
        "expected-outputs-many",
        {"probe": {"request": _infer([1.0]), "expectedOutputs": [{"name": "y"}] * MANY}},
        "spec.probe.expectedOutputs",
    ),
    (
        "expected-values-many",
        {
            "probe": {
                "request": _infer([1.0]),
                "expectedOutputs": [{"name": "y", "data": [0.0] * MANY}],
            }
        },
        "spec.probe.expectedOutputs[0].data",
    ),
    (
        "request-nested",
        {"probe": {"request": _infer([_deep(50)])}},
        "spec.probe.request.inputs[0].data",
    ),
    (
        "request-nested-object",
        {"probe": {"request": _infer([{"a": {"b": 1}}])}},
        "spec.probe.request.inputs[0].data",
    ),
    (
        "request-many-values",
        {"probe": {"request": _infer([0.0] * (limits.REQUEST_VALUES + 1))}},
        "spec.probe.request.inputs[0].data",
    ),
    (
        "request-string-data",
        {"probe": {"request": _infer(["x"])}},
        "spec.probe.request.inputs[0].data[0]",
    ),
    (
        "request-unknown-field",
        {"probe": {"request": {**_infer([1.0]), "payload": _deep(50)}}},
        "spec.probe.request.payload",
    ),
    # ranks (tensor x pipeline) that do not split evenly over the replica's pods
    (
        "ranks-uneven-over-pods",
        {"parallelism": {"tensor": 3, "podsPerReplica": 2}},
        "spec.parallelism.podsPerReplica",
    ),
    (
        "more-pods-than-ranks",
        {"parallelism": {"tensor": 2, "pipeline": 1, "podsPerReplica": 4}},
        "spec.parallelism.podsPerReplica",
    ),
    ("pods-zero", {"parallelism": {"podsPerReplica": 0}}, "spec.parallelism.podsPerReplica"),
    (
        "pipeline-many",
        {"parallelism": {"pipeline": limits.PIPELINE_MAX + 1}},
        "spec.parallelism.pipeline",
    ),
    ("warm-spares-many", {"warmSpares": limits.WARM_SPARES_MAX + 1}, "spec.warmSpares"),
    ("warm-spares-negative", {"warmSpares": -1}, "spec.warmSpares"),
    (
        "warm-spares-preload",
        {"warmSpares": 1, "loading": {"strategy": "Preload"}},
        "spec.warmSpares",
    ),
    (
        "warm-spares-external",
        {"warmSpares": 1, "runtime": {"type": "External", "command": ["tritonserver"]}},
        "spec.warmSpares",
    ),
    # an External runtime's protocol, its health paths and port (issue 46)
    ("protocol-unknown", _external(protocol="gRPC"), "spec.runtime.protocol"),
    ("readiness-path-relative", _external(readinessPath="health"), "spec.runtime.readinessPath"),
    ("liveness-path-space", _external(livenessPath="/a b"), "spec.runtime.livenessPath"),
    ("liveness-path-empty", _external(livenessPath=""), "spec.runtime.livenessPath"),
    ("external-port-low", _external(port=80), "spec.runtime.port"),
    ("protocol-on-builtin", {"runtime": {"protocol": "Triton"}}, "spec.runtime.protocol"),
    ("path-on-builtin", {"runtime": {"livenessPath": "/live"}}, "spec.runtime.livenessPath"),
    ("openai-without-completion", _external(protocol="OpenAI"), "spec.probe.completion"),
    (
        "openai-with-generate",
        _external({"completion": {**_COMPLETION, "protocol": "TritonGenerate"}}, protocol="OpenAI"),
        "spec.probe.completion.protocol",
    ),
    (
        "triton-with-openai",
        _external({"completion": {**_COMPLETION, "protocol": "OpenAI"}}, protocol="Triton"),
        "spec.probe.completion.protocol",
    ),
    # the GPU resource is named by the template, counted by the operator (issue 45)
    (
        "gpu-resource-native",
        _template(gpuResource="kubernetes.io/gpu"),
        "spec.template.gpuResource",
    ),
    ("gpu-resource-unprefixed", _template(gpuResource="gpu"), "spec.template.gpuResource"),
    (
        "gpu-count-in-limits",
        {"parallelism": {"tensor": 2}, **_template(resources={"limits": {"nvidia.com/gpu": "1"}})},
        "spec.template.resources.limits",
    ),
    (
        "gpu-count-in-requests-renamed",
        {
            "parallelism": {"tensor": 4, "podsPerReplica": 2},
            **_template(
                gpuResource="nvidia.com/mig-1g.10gb",
                resources={"requests": {"nvidia.com/mig-1g.10gb": "4"}},
            ),
        },
        "spec.template.resources.requests",
    ),
    ("service-type", {"service": {"type": "ExternalName"}}, "spec.service.type"),
    ("service-port-zero", {"service": {"port": 0}}, "spec.service.port"),
    ("service-port-high", {"service": {"port": 65536}}, "spec.service.port"),
    ("service-enabled-text", {"service": {"enabled": "yes"}}, "spec.service.enabled"),
    ("service-unknown-field", {"service": {"selector": {"a": "b"}}}, "spec.service.selector"),
]


@pytest.mark.parametrize(("name", "spec", "field"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_spec_refused_naming_the_field(
    crd: str, kubectl: Kubectl, namespace: str, name: str, spec: dict[str, Any], field: str
) -> None:
    code, out = dry_run(kubectl, namespace, md(name, **spec))
    assert code != 0, f"the API server admitted {name}"
    assert field in out, out[:2000]


def test_uneven_ranks_refused_with_the_cel_message(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    """The CEL rule (not a schema bound) refuses it, at the field, with the rule's words."""
    spec = {"parallelism": {"tensor": 2, "pipeline": 3, "podsPerReplica": 4}}
    code, out = dry_run(kubectl, namespace, md("uneven", **spec))
    assert code != 0, "the API server admitted 6 ranks over 4 pods"
    assert f"spec.parallelism.podsPerReplica: Invalid value: {PARALLELISM_MESSAGE}" in out, out


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        (_external(protocol="OpenAI"), "spec.probe.completion", PROBE_NEEDS_COMPLETION_MESSAGE),
        (
            _external({"completion": {**_COMPLETION, "protocol": "OpenAI"}}, protocol="Triton"),
            "spec.probe.completion.protocol",
            COMPLETION_PROTOCOL_MESSAGE,
        ),
    ],
    ids=["openai-needs-completion", "triton-answers-generate"],
)
def test_protocol_probe_rules_refused_with_the_cel_message(
    crd: str, kubectl: Kubectl, namespace: str, spec: dict[str, Any], field: str, message: str
) -> None:
    """The CEL rules drawn from PROTOCOL_ENDPOINTS refuse at the field, with pydantic's words."""
    code, out = dry_run(kubectl, namespace, md("protocol", **spec))
    assert code != 0, "the API server admitted a probe the runtime's server cannot answer"
    assert f"{field}: Invalid value: {message}" in out, out


def test_single_pod_defaults_applied_at_admission(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    """A spec that says nothing of parallelism is stored as today's one pod of one rank."""
    proc = kubectl(
        "create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(md("defaults"))
    )
    stored = json.loads(proc.stdout)["spec"]
    assert stored["parallelism"] == {
        "tensor": 1,
        "pipeline": 1,
        "podsPerReplica": 1,
        "maxGroupRestarts": 3,  # issue 47: a group recreated 3 times in a row is left Failed
    }
    # ...and with its Service on (issue 45): a ClusterIP on port 80.
    assert stored["service"] == {"enabled": True, "type": "ClusterIP", "port": 80}


def test_request_deeper_than_python_decodes_is_refused(
    crd: str, kubectl: Kubectl, namespace: str
) -> None:
    """5000 levels: more than json.loads in the operator or worker could decode (RecursionError),
    written by hand since json.dumps cannot produce it either."""
    depth = 5000
    text = json.dumps(md("deep", probe={"request": _infer(["DEEP"])}))
    text = text.replace('"DEEP"', "[" * depth + "1" + "]" * depth)
    proc = kubectl("apply", "-n", namespace, "--dry-run=server", "-f", "-", input=text, check=False)
    assert proc.returncode != 0, "the API server admitted a 5000-level request"
    assert "spec.probe.request.inputs[0].data" in proc.stderr, proc.stderr[:2000]


ADMITTED: list[tuple[str, dict[str, Any]]] = [
    ("library-relative", {"initHooks": {"library": "hooks/libinit.so"}}),
    ("library-dot", {"initHooks": {"library": "./hooks/lib..init.so"}}),
    ("uri-dot", {"model": {"uri": "pvc://models/./tiny..v2"}}),
    (
        "library-absolute-allowed",
        {"initHooks": {"library": "/opt/hooks/libinit.so", "allowOutsideModelDir": True}},
    ),
    ("env-plain", _template(env=[{"name": "HF_HOME", "value": "/tmp/hf"}])),
    ("warm-spares", {"warmSpares": 2, "loading": {"strategy": "PeerToPeer"}}),
    ("service-off", {"service": {"enabled": False}}),
    ("service-node-port", {"service": {"type": "NodePort", "port": 8080}}),
    ("service-load-balancer", {"service": {"type": "LoadBalancer", "port": 443}}),
    # stored as written: no protocol defaulted into the runtime or the completion probe
    (
        "external-openai",
        _external(
            {"completion": _COMPLETION},
            protocol="OpenAI",
            port=9000,
            readinessPath="/health?ready=1",
            livenessPath="/health",
        ),
    ),
    ("external-triton", _external({"completion": _COMPLETION}, protocol="Triton")),
    ("external-unnamed", _external({"completion": {**_COMPLETION, "protocol": "TritonGenerate"}})),
    ("two-pods-per-replica", {"parallelism": {"tensor": 2, "podsPerReplica": 2}}),
    (
        "mig-resource-with-its-count",
        {
            "parallelism": {"tensor": 4, "podsPerReplica": 2},
            **_template(
                gpuResource="nvidia.com/mig-1g.10gb",
                resources={"limits": {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/gpu": "1"}},
            ),
        },
    ),
    ("tp-pp-over-pods", {"parallelism": {"tensor": 4, "pipeline": 2, "podsPerReplica": 4}}),
    ("image-digest", _template(image="registry.example.com:5000/team/worker@sha256:" + "a" * 64)),
    ("image-tag", _template(image="localhost/weightlift-worker:dev-1.2")),
    (
        "scheduling",
        _template(
            nodeSelector={"kubernetes.io/hostname": "gpu-1", "gpu": ""},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            resources={"requests": {"cpu": "500m", "memory": "8Gi"}, "limits": {"memory": "1e9"}},
            serviceAccountName="weightlift-worker",
        ),
    ),
    (
        "probe",
        {
            "probe": {
                "request": {
                    "id": "p",
                    "inputs": [
                        {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2]},
                        {"name": "t", "datatype": "INT64", "shape": [1], "data": [7]},
                    ],
                    "outputs": [{"name": "y"}],
                },
                "expectedOutputs": [{"name": "y", "shape": [1, 2], "data": [0.5, 1.0]}],
            }
        },
    ),
]


@pytest.mark.parametrize(("name", "spec"), ADMITTED, ids=[a[0] for a in ADMITTED])
def test_legitimate_spec_admitted_unchanged(
    crd: str, kubectl: Kubectl, namespace: str, name: str, spec: dict[str, Any]
) -> None:
    obj = md(name, **spec)
    proc = kubectl("create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(obj))
    stored = json.loads(proc.stdout)["spec"]
    for key, value in spec.items():
        assert stored[key] | value == stored[key], f"{key}: stored {stored[key]!r}"
