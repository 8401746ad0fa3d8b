"""Pod Security Admission: what of a ModelDeployment needs a namespace above `restricted`.

A worker pod is `restricted`-clean by itself (non-root uid 1000, no privilege escalation, every
capability dropped, RuntimeDefault seccomp; emptyDir, configMap, secret, projected and PVC volumes
only). Four things take it to `baseline`, and the API server names none of them by their spec
field: a hostpath:// model and the node model cache (hostPath volumes), RDMA (IPC_LOCK, to pin
memory), and the operator's node compile store (a hostPath, chart value compileStore). The first
three are the user's asks: a refusal names their fields. The node store is the operator's own
speed-up: where `restricted` refuses it, the operator renders the namespace's pods without it
(vLLM compiles, or uses the cluster store) and says so once in an Event.
"""

from __future__ import annotations

from weightlift.api.model import ModelDeploymentSpec
from weightlift.api.uri import REMOTE_SCHEMES, ModelUri

# How the API server's PodSecurity admission words a refusal (k8s.io/pod-security-admission).
REFUSAL = "violates PodSecurity"
NODE_STORE_OFF_REASON = "NodeCompileStoreOff"


def refused_by_pod_security(api_message: str) -> bool:
    return REFUSAL in api_message


def baseline_features(spec: ModelDeploymentSpec) -> list[str]:
    """The spec's fields that a `restricted` namespace refuses, each with why."""
    found: list[str] = []
    uri = ModelUri.parse(spec.model.uri)
    if uri.scheme == "hostpath":
        found.append("spec.model.uri hostpath:// (a hostPath volume; use pvc:// or s3://)")
    if uri.scheme in REMOTE_SCHEMES and spec.loading.cache.enabled:
        found.append("spec.loading.cache.enabled (the node model cache is a hostPath volume)")
    if spec.template.rdma_resource:
        found.append("spec.template.rdmaResource (RDMA adds the IPC_LOCK capability)")
    if spec.template.rdma_resources:
        found.append("spec.template.rdmaResources (RDMA adds the IPC_LOCK capability)")
    return found


def refusal_message(spec: ModelDeploymentSpec, namespace: str, api_message: str) -> str:
    """Why the pod was refused, in the spec's words first, then the API server's."""
    features = baseline_features(spec)
    level = (
        f"namespace {namespace} enforces a PodSecurity level these need at least baseline for: "
        + "; ".join(features)
        if features
        else f"namespace {namespace}'s PodSecurity level refuses the worker pod"
    )
    return f"{level}. The API server: {api_message}"


def node_store_off_message(namespace: str, store: str) -> str:
    return (
        f"the node compile store ({store}, a hostPath) is off for pods in namespace {namespace}: "
        "its PodSecurity level refuses hostPath volumes. Replicas compile, or use the cluster "
        "store (chart value compileStoreUri: s3:// or pvc://); label the namespace "
        "pod-security.kubernetes.io/enforce=baseline to keep the node store."
    )
