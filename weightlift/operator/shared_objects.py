"""The objects beside the worker pods: the plan ConfigMap and the P2P token Secret.

Why a ConfigMap per ModelDeployment revision, not a plan per pod in env: a pod's env is the
worker's argv/environ, bounded by ARG_MAX (a 10k-value expected output overflowed it), while a
ConfigMap holds up to 1 MiB. The large part of the plan (model, loading, hooks, runtime, probe
with its expected outputs) is the same for every replica of a revision, so one ConfigMap serves
them all: one API create per revision, not per pod (1000 deployments x 4 replicas stay 1000
creates). It is named by its content's digest, immutable (kubelets need not watch it, and it
cannot be edited in place), owned by the ModelDeployment (deleted with it) and swept once no pod
of an older revision is left (`sweep_selector`). Each pod carries the digest in its env and the
worker refuses any other content (worker/plan.py says what that defends against). What differs
per replica (pod, role, peers, model dir) is small and stays in env.

Why a P2P token per model identity, not per ModelDeployment: replicas of different
ModelDeployments with the same identity feed each other (api.model.pulls_from_peers,
api.labels.published_sources_selector), so the token must be shared by exactly that set. The
Secret is owned by every ModelDeployment that uses it (the garbage collector deletes it when the
last one goes) and reaches workers only as a secretKeyRef env: the operator never reads it back.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from weightlift.api.labels import DEPLOYMENT_LABEL, IDENTITY_LABEL, MANAGED_BY, PLAN_LABEL
from weightlift.api.model import GROUP, KIND, VERSION
from weightlift.api.worker import PEER_TOKEN_KEY, PLAN_KEY, SharedPlan, plan_digest

# Digest characters in names and labels (label values stay within 63).
DIGEST_CHARS = 12
TOKEN_BYTES = 32


@dataclass(frozen=True)
class PlanConfigMap:
    name: str
    digest: str  # sha256 of `text`, full
    text: str

    @property
    def label(self) -> str:
        return self.digest[:DIGEST_CHARS]


def owner(name: str, uid: str) -> dict[str, Any]:
    """An owner reference to the ModelDeployment; not blockOwnerDeletion (that needs update on
    its finalizers, a right the operator does not need otherwise)."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid}


def plan_configmap(deployment: str, shared: SharedPlan) -> PlanConfigMap:
    text = shared.to_text()
    digest = plan_digest(text)
    return PlanConfigMap(f"{deployment}-plan-{digest[:DIGEST_CHARS]}", digest, text)


def configmap_manifest(
    plan: PlanConfigMap, namespace: str, deployment: str, uid: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan.name,
            "namespace": namespace,
            "labels": {**MANAGED_BY, DEPLOYMENT_LABEL: deployment, PLAN_LABEL: plan.label},
            "annotations": {"weightlift.dev/plan-sha256": plan.digest},
            "ownerReferences": [owner(deployment, uid)],
        },
        "immutable": True,
        "data": {PLAN_KEY: plan.text},
    }


def sweep_selector(deployment: str, keep: set[str]) -> str:
    """Label selector of this deployment's plan ConfigMaps other than those in `keep`."""
    kept = ",".join(sorted(keep))
    return f"{DEPLOYMENT_LABEL}={deployment},{PLAN_LABEL},{PLAN_LABEL} notin ({kept})"


def token_secret_name(identity: str) -> str:
    return f"weightlift-peer-{identity}"


def token_secret_manifest(
    identity: str, namespace: str, deployment: str, uid: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(identity),
            "namespace": namespace,
            "labels": {**MANAGED_BY, IDENTITY_LABEL: identity},
            "ownerReferences": [owner(deployment, uid)],
        },
        "type": "Opaque",
        "stringData": {PEER_TOKEN_KEY: secrets.token_urlsafe(TOKEN_BYTES)},
    }
