"""Read this worker's plan: the shared part from the operator's ConfigMap, checked against the
sha256 the pod spec carries, plus the per-replica assignment from the environment.

What the digest defends against: a plan ConfigMap that is not the one the operator wrote when it
created this pod. Someone who may write ConfigMaps in the namespace but not Pods (a common
namespace-editor split) could otherwise delete and recreate it (the operator makes it immutable)
with another init library, probe, model dir or runtime and have the operator's pods run it; a
ConfigMap left over under the same name from another revision would be loaded silently. The
digest lives in the pod's env, which cannot change after the pod is created, so the worker
refuses any other plan and never serves.

What it does not defend against: anyone who may create or edit Pods (they write the digest too),
the operator itself, a node or kubelet that lies about files or env, or reading the plan: a
ConfigMap is not secret, so nothing secret goes in it (the P2P token comes from a Secret).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    PLAN_CONFIGMAP_ENV,
    PLAN_FILE_ENV,
    PLAN_SHA256_ENV,
    Assignment,
    SharedPlan,
    WorkerPlan,
    plan_digest,
)


class PlanRefused(ValueError):
    """The plan is missing, not the operator's (digest mismatch) or malformed."""


def read_plan(environ: Mapping[str, str] | None = None) -> WorkerPlan:
    env = os.environ if environ is None else environ
    missing = [k for k in (PLAN_FILE_ENV, PLAN_SHA256_ENV, ASSIGNMENT_ENV) if not env.get(k)]
    if missing:
        raise PlanRefused(f"{', '.join(missing)} not set and no --plan file was given")
    configmap = env.get(PLAN_CONFIGMAP_ENV) or "?"
    path = Path(env[PLAN_FILE_ENV])
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanRefused(
            f"cannot read the plan of ConfigMap {configmap} at {path}: {exc}"
        ) from None
    want, got = env[PLAN_SHA256_ENV].lower(), plan_digest(text)
    if not hmac.compare_digest(want, got):
        raise PlanRefused(
            f"plan of ConfigMap {configmap} ({path}) is not the operator's: its sha256 is {got}, "
            f"the pod expects {want} ({PLAN_SHA256_ENV}); refusing to run it"
        )
    try:
        shared = SharedPlan.model_validate_json(text)
    except ValidationError as exc:
        raise PlanRefused(f"plan of ConfigMap {configmap} is invalid: {exc}") from None
    try:
        assignment = Assignment.model_validate_json(env[ASSIGNMENT_ENV])
    except ValidationError as exc:
        raise PlanRefused(f"{ASSIGNMENT_ENV} is invalid: {exc}") from None
    return WorkerPlan.compose(shared, assignment)
