"""Shapes and sizes the API admits: Kubernetes name patterns and the bounds of every list and
string of a ModelDeployment. One place, so the CRD (admission), the operator and the worker agree.

Patterns are written for both Go's RE2 (the API server) and Rust's regex (pydantic-core):
no look-around, no backreferences.
"""

from __future__ import annotations

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# RFC 1123 subdomain: ServiceAccount, Secret and ConfigMap names; label key prefixes.
DNS_SUBDOMAIN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$"
DNS_SUBDOMAIN_MAX = 253
_QUALIFIED_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
# Label keys and extended resource names: [prefix/]name.
QUALIFIED_NAME = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_QUALIFIED_NAME}$"
QUALIFIED_NAME_MAX = 317  # 253 prefix + "/" + 63 name
# An extended resource name: a qualified name whose domain prefix is required and is not
# kubernetes.io's (native resources; checked apart, RE2 has no look-around).
EXTENDED_RESOURCE = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*/{_QUALIFIED_NAME}$"
NATIVE_RESOURCE_DOMAIN = "kubernetes.io/"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
LABEL_VALUE_MAX = 63
# resource.Quantity's canonical forms: 2, 0.5, 500m, 8Gi, 1e3.
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
QUANTITY_MAX = 64
# A container image reference: [registry[:port]/]path[:tag][@digest]; no spaces or shell syntax.
IMAGE = (
    r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]+)?/)?"
    r"[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[a-z0-9]+([+._-][a-z0-9]+)*:[a-fA-F0-9]{32,})?$"
)
IMAGE_MAX = 512
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
ENV_NAME_MAX = 128
# Environment the worker owns: its plan and bind address (WEIGHTLIFT_*) and the dynamic
# loader's knobs (LD_PRELOAD, LD_LIBRARY_PATH...), which would run code next to the weights.
RESERVED_ENV_PREFIXES = ("WEIGHTLIFT_", "LD_")
# No NUL: execve cannot pass it, and a C string would silently end there.
NO_NUL = r"^[^\x00]*$"
# An HTTP probe path (the kubelet's httpGet): absolute, printable ASCII, no spaces.
HTTP_PATH = r"^/[!-~]*$"
HTTP_PATH_MAX = 256

# Bounds: the largest admissible spec stays below 1 MiB (a worker plan fits one ConfigMap;
# tests/unit/api/test_crd.py measures it) and CEL rules stay within their cost budget.
ENV_VALUE_MAX = 2048
ENV_ITEMS = 64
TOLERATION_ITEMS = 32
NODE_SELECTOR_ITEMS = 32
RESOURCE_ITEMS = 16
COMMAND_ITEMS = 128
ARG_MAX_LENGTH = 1024
EXPECTED_OUTPUTS = 8
EXPECTED_VALUES = 1024
SHAPE_DIMS = 8
NAME_MAX = 256
# spec.parallelism: ranks per stage, stages, and pods per replica (one LeaderWorkerSet group).
TENSOR_MAX = 64
PIPELINE_MAX = 64
PODS_PER_REPLICA_MAX = 64
# spec.parallelism.maxGroupRestarts: a group recreated more often in a row is broken, not unlucky.
GROUP_RESTARTS_MAX = 100
# spec.warmSpares: each spare is a GPU pod held idle; more than this is a mistake, not a pool.
WARM_SPARES_MAX = 64
# probe.request: its JSON text, nesting depth, inputs/outputs/parameters, values per input.
REQUEST_MAX_BYTES = 512 * 1024  # above what the CRD admits: a backstop for unadmitted specs
REQUEST_MAX_DEPTH = 8
REQUEST_ITEMS = 8
REQUEST_VALUES = 1024  # as many as an expected output holds; the demo probes 2 x 512


def json_depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON-like value, iteratively (a deep value must not exhaust the
    stack here); stops counting once past ``limit``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return deepest
