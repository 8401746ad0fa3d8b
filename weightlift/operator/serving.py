"""Apply what carries the inference probe to a Service: the pods' readiness-gate conditions
(planning decides them, `Plan.gates`) and the ModelDeployment's Service (service.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from weightlift.api.labels import INFERENCE_PROBE_GATE
from weightlift.api.model import ModelDeploymentSpec
from weightlift.api.times import now_rfc3339
from weightlift.operator import kube
from weightlift.operator.planning import Plan
from weightlift.operator.service import render_service, service_name
from weightlift.operator.state import CREATED_POD_WAIT_SECONDS, OperatorState

Log = logging.Logger | logging.LoggerAdapter[Any]


def gate_condition(passed: bool) -> dict[str, Any]:
    return {
        "type": INFERENCE_PROBE_GATE,
        "status": "True" if passed else "False",
        "reason": "InferenceProbePassed" if passed else "NotServingProbed",
        "message": "the replica passed its inference probe"
        if passed
        else "the replica's inference probe has not passed, or it is not serving",
        "lastTransitionTime": now_rfc3339(),
    }


async def set_gates(
    state: OperatorState, namespace: str, result: Plan, uids: Mapping[str, str | None], log: Log
) -> None:
    """One pods/status patch per transition, all at once. A write the index does not show yet
    is not sent again for a while (PodRecord.gate_sent), as with hand-offs."""

    async def write(pod: str, passed: bool) -> None:
        uid = uids.get(pod)
        record = state.pod(uid) if uid else None
        if record is not None and record.gate_sent is not None:
            value, until = record.gate_sent
            if value == passed and time.monotonic() < until:
                return
        log.info("pod %s: inference-probe gate %s", pod, passed)
        try:
            condition = gate_condition(passed)
            await asyncio.to_thread(kube.set_pod_condition, state.core, namespace, pod, condition)
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile needs nothing
                raise
            return
        if record is not None:
            record.gate_sent = (passed, time.monotonic() + CREATED_POD_WAIT_SECONDS)

    await asyncio.gather(*(write(pod, passed) for pod, passed in result.gates.items()))


async def ensure_service(
    state: OperatorState, meta: Mapping[str, Any], spec: ModelDeploymentSpec, log: Log
) -> str | None:
    """The Service as spec.service wants it: applied once per operator life and on each change,
    deleted when turned off (only one this operator applied). Returns what the API server
    refused, if it did."""
    namespace, name = meta["namespace"], meta["name"]
    record = state.deployment(meta["uid"])
    if not spec.service.enabled:
        if record.service is not None:
            applied = json.loads(record.service)["metadata"]["name"]
            await asyncio.to_thread(kube.delete_service, state.core, namespace, applied)
            log.info("deleted Service %s: spec.service.enabled is false", applied)
            record.service = None
        return None
    manifest = render_service(name, namespace, meta["uid"], spec)
    text = json.dumps(manifest, sort_keys=True)
    if record.service == text:
        return None
    try:
        await asyncio.to_thread(kube.apply_service, state.core, namespace, manifest)
    except ApiException as exc:
        return f"Service {service_name(name)} was rejected: {kube.api_error(exc)}"
    if record.service is None:
        log.info("Service %s selects the serving replicas", service_name(name))
    record.service = text
    return None
