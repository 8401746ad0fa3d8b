"""Vendor the Kubernetes core/v1 definitions spec.template embeds (weightlift/api/data/).

Fetched from the local control plane's own kube-apiserver (hack/build-controlplane.sh pins its
version), GET /openapi/v3/api/v1: the types a PodTemplateSpec's worker pod may carry, with
every definition they reference (closure), descriptions kept for `kubectl explain`.

    PYTHONPATH=. .venv/bin/python hack/fetch_pod_openapi.py

Re-run after bumping K8S_VERSION; `tests/unit/api/test_podspec_schema.py` checks the file.
"""

from __future__ import annotations

import json
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from weightlift.local.cluster import ControlPlane, GpuNodeSpec

OUT = Path(__file__).resolve().parent.parent / "weightlift/api/data/core-v1-pod-openapi.json"
PREFIX = "io.k8s.api.core.v1."
ROOTS = (
    "Affinity",
    "Toleration",
    "TopologySpreadConstraint",
    "LocalObjectReference",
    "Volume",
    "VolumeMount",
    "EnvVar",
    "EnvFromSource",
    "Container",
    "PodSecurityContext",
    "SecurityContext",
    "ResourceRequirements",
)


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_refs, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
    for value in node.values():
        found |= _refs(value)
    return found


def closure(schemas: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    """The roots and every definition they reference, transitively."""
    out: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = schemas[name]
        todo += sorted(_refs(schemas[name]) - set(out))
    return dict(sorted(out.items()))


def main() -> int:
    with (
        tempfile.TemporaryDirectory(prefix="wl-openapi-") as state,
        ControlPlane(Path(state), nodes=GpuNodeSpec(count=0), bind_to_parent=True) as info,
    ):
        ctx = ssl.create_default_context(cafile=str(info.ca_file))
        headers = {"Authorization": f"Bearer {info.token}"}
        with httpx.Client(base_url=info.server, verify=ctx, headers=headers) as api:
            version = api.get("/version").raise_for_status().json()["gitVersion"]
            doc = api.get("/openapi/v3/api/v1").raise_for_status().json()
    schemas = doc["components"]["schemas"]
    definitions = closure(schemas, [PREFIX + name for name in ROOTS])
    vendored = {
        "kubernetesVersion": version,
        "source": "kube-apiserver GET /openapi/v3/api/v1 (hack/fetch_pod_openapi.py)",
        "roots": [PREFIX + name for name in ROOTS],
        "definitions": definitions,
    }
    OUT.write_text(json.dumps(vendored, indent=1, sort_keys=False) + "\n")
    print(f"{OUT}: {len(definitions)} definitions from {version}, {OUT.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
