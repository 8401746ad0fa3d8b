"""The Service in front of a ModelDeployment's serving replicas (spec.service): pure functions
from the spec to its manifest and to what the status says of it.

It selects the deployment's pods that carry the weightlift.dev/serving label (planning._serving:
handed their weights, never warm spares nor targets still waiting for a source), and the
readiness gate makes an endpoint ready only once its replica passed the inference probe.
"""

from __future__ import annotations

import re
from typing import Any

from weightlift.api.labels import DEPLOYMENT_LABEL, MANAGED_BY, SERVING_LABEL
from weightlift.api.model import (
    GROUP,
    KIND,
    VERSION,
    Engine,
    ModelDeploymentSpec,
    RuntimeType,
    ServiceStatus,
)

# A Service's name is a DNS-1035 label; a ModelDeployment's may start with a digit or hold dots.
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def service_name(deployment: str) -> str:
    """The deployment's own name when a Service may have it, else md-<name, dots as dashes>."""
    if _DNS_1035.fullmatch(deployment):
        return deployment
    return "md-" + deployment.replace(".", "-")


def service_ports(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """http (spec.service.port) to the worker's port, and Triton's own HTTP and gRPC ports with
    runtime.engine Triton (Triton listens on the pod IP; vLLM only on the pod's loopback, behind
    the worker's /v1). Each targets the container port of the same name (pods.container_ports)."""
    rt = spec.runtime
    ports = [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}]
    if rt.type == RuntimeType.BUILTIN and rt.engine == Engine.TRITON:
        for name, port in (("triton-http", rt.engine_port), ("triton-grpc", rt.engine_grpc_port)):
            if all(p["port"] != port for p in ports):  # a Service's port numbers are unique
                ports.append({"name": name, "port": port, "targetPort": name, "protocol": "TCP"})
    return ports


def service_selector(deployment: str) -> dict[str, str]:
    return {DEPLOYMENT_LABEL: deployment, SERVING_LABEL: "true"}


def render_service(
    deployment: str, namespace: str, uid: str, spec: ModelDeploymentSpec
) -> dict[str, Any]:
    """The Service, owned by the ModelDeployment (the garbage collector deletes it with it)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(deployment),
            "namespace": namespace,
            "labels": {**MANAGED_BY, DEPLOYMENT_LABEL: deployment},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": deployment,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "type": str(spec.service.type),
            "selector": service_selector(deployment),
            "ports": service_ports(spec),
        },
    }


def service_status(deployment: str, spec: ModelDeploymentSpec) -> ServiceStatus | None:
    """What status.service says (None with spec.service.enabled false)."""
    if not spec.service.enabled:
        return None
    ports = ",".join(f"{p['name']}:{p['port']}/{p['protocol']}" for p in service_ports(spec))
    return ServiceStatus(name=service_name(deployment), type=spec.service.type, ports=ports)
