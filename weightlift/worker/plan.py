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
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from weightlift.api.model import Engine
from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    GROUP_INDEX_ENV,
    GROUP_SIZE_ENV,
    PEERS_FILE_ENV,
    PLAN_CONFIGMAP_ENV,
    PLAN_FILE_ENV,
    PLAN_SHA256_ENV,
    Assignment,
    SharedPlan,
    WorkerPlan,
    group_ranks,
    plan_digest,
)

# The pod's own IP: the process node sets WEIGHTLIFT_BIND_HOST (each pod a 127.x address on the
# host's network), a real pod POD_IP (the downward API).
BIND_HOST_ENV = "WEIGHTLIFT_BIND_HOST"
POD_IP_ENV = "POD_IP"
# The pod's own name (the downward API): one LeaderWorkerSet template serves every pod of every
# group, so the assignment's pod name is the template's, not this pod's.
POD_NAME_ENV = "POD_NAME"


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


class GroupRefused(PlanRefused):
    """A pod of a multi-pod replica cannot take its place (env, plan or engine): permanent,
    another start gets the same env and plan."""

    permanent = True


@dataclass(frozen=True)
class GroupPlace:
    """This pod's place in its replica's group (a LeaderWorkerSet group)."""

    index: int  # rank in the group's torch.distributed group; 0 is the leader
    size: int
    # This pod's IP when known: the group rendezvous listens (leader) and gloo binds there.
    pod_ip: str | None

    @property
    def leader(self) -> bool:
        return self.index == 0


def group_place(
    plan: WorkerPlan, environ: Mapping[str, str] | None = None
) -> tuple[WorkerPlan, GroupPlace | None]:
    """A pod of a multi-pod replica (`pods_per_replica` > 1): the plan narrowed to this pod's
    ranks (by its LWS index) and its place; any other plan unchanged with None. Raises
    GroupRefused when the pod's env and the plan disagree, or the plan asks for what a group
    cannot run (Triton, pipeline stages)."""
    pods = plan.pods_per_replica
    if pods is None or pods <= 1:
        return plan, None
    env = os.environ if environ is None else environ
    raw_index, raw_size = env.get(GROUP_INDEX_ENV), env.get(GROUP_SIZE_ENV)
    try:
        index = int(raw_index or "")
        size = int(raw_size or "")
    except ValueError:
        raise GroupRefused(
            f"a pod of a {pods}-pod replica needs integers in {GROUP_INDEX_ENV} and "
            f"{GROUP_SIZE_ENV} (LeaderWorkerSet sets both), got {GROUP_INDEX_ENV}={raw_index!r} "
            f"and {GROUP_SIZE_ENV}={raw_size!r}"
        ) from None
    if size != pods:
        raise GroupRefused(
            f"{GROUP_SIZE_ENV}={size} but the plan's podsPerReplica is {pods}: this pod's "
            "LeaderWorkerSet is not the one the plan was written for"
        )
    if plan.runtime.engine not in (Engine.BUILTIN, Engine.VLLM):
        raise GroupRefused(
            f"runtime.engine {plan.runtime.engine} cannot span {pods} pods: multi-pod replicas "
            f"run the builtin runtime or vLLM"
        )
    if (plan.pipeline_parallel or 1) > 1 or len(plan.ranks) != plan.tensor_parallel:
        raise GroupRefused(
            f"a {pods}-pod replica runs tensor-parallel ranks only: pipeline "
            f"{plan.pipeline_parallel or 1}, {len(plan.ranks)} ranks for tensor "
            f"{plan.tensor_parallel}"
        )
    if not env.get(PEERS_FILE_ENV):
        raise GroupRefused(
            f"a pod of a {pods}-pod replica learns its role and leader from its hand-off file, "
            f"but {PEERS_FILE_ENV} is not set"
        )
    try:
        ranks = group_ranks(list(plan.ranks), pods, index)
    except ValueError as exc:
        raise GroupRefused(f"{GROUP_INDEX_ENV}={index}: {exc}") from None
    pod_ip = env.get(BIND_HOST_ENV) or env.get(POD_IP_ENV) or None
    pod_name = env.get(POD_NAME_ENV) or plan.pod_name
    narrowed = plan.model_copy(update={"ranks": ranks, "pod_name": pod_name})
    return narrowed, GroupPlace(index, size, pod_ip)
