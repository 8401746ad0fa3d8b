"""One status write per state change: progress within a phase is coalesced, state changes are
written at once, and a held write is made by a later pass, from the one path (reconcile.apply)."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import pytest

from weightlift.api.model import ModelDeploymentStatus, Phase, SourceEndpoint
from weightlift.operator import kube, reconcile, statuswrites
from weightlift.operator.planning import Plan
from weightlift.operator.state import OperatorState
from weightlift.operator.statuswrites import STATUS_COALESCE_SECONDS, state_key, write_in

UID = "3c1f7c3e-0000-4000-8000-000000000002"
LOG = logging.getLogger("test")


def _source(pod: str) -> dict[str, Any]:
    return {"pod": pod, "deployment": "llama", "address": "127.0.0.1:1", "modelIdentity": "i"}


def _status(
    phase: str = "Loading", ready: int = 1, sources: int = 1, **more: Any
) -> dict[str, Any]:
    return {
        "phase": phase,
        "message": f"phase {phase}",
        "observedGeneration": 1,
        "modelIdentity": "i",
        "readyReplicas": ready,
        "loaded": f"{25 * ready}%",
        "conditions": [
            {"type": "Ready", "status": str(phase == "Ready"), "reason": phase, "message": ""}
        ],
        "sources": [_source(f"p-{i}") for i in range(sources)],
        **more,
    }


def test_state_changes_are_written_at_once_progress_is_held() -> None:
    written = state_key(_status())
    assert write_in(_status(), None, 0.0) == 0.0  # nothing written yet by this operator
    assert write_in(_status("Ready"), written, 0.1) == 0.0
    assert write_in(_status(observedGeneration=2), written, 0.1) == 0.0
    assert write_in(_status(message="quota exceeded"), written, 0.1) == 0.0
    assert write_in(_status(sources=0), written, 0.1) == 0.0  # a source withdrawn
    assert write_in(_status(sources=1), state_key(_status(sources=0)), 0.1) == 0.0  # the first
    # One more replica Ready, serving or spare: what kubectl, the scale subresource and an HPA read.
    assert write_in(_status(ready=2), written, 0.1) == 0.0
    assert write_in(_status(replicas=2), state_key(_status(replicas=1)), 0.1) == 0.0
    assert write_in(_status(spares=0), state_key(_status(spares=1)), 0.1) == 0.0
    # Progress: loaded bytes and one more source, a second after the last write.
    progress = _status(sources=2, loaded="60%")
    assert write_in(progress, written, 1.0) == STATUS_COALESCE_SECONDS - 1.0
    assert write_in(progress, written, STATUS_COALESCE_SECONDS) == 0.0


def _plan(status: dict[str, Any]) -> Plan:
    return Plan(status=ModelDeploymentStatus.model_validate(status), requeue_after=30.0)


async def test_a_held_write_is_made_by_a_later_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "patch_status", lambda api, ns, name, body: writes.append(body))
    state = OperatorState(core=cast(Any, None), custom=cast(Any, None), http=cast(Any, None))
    body = {"metadata": {"name": "llama", "namespace": "ns", "uid": UID}}

    async def apply(status: dict[str, Any]) -> Plan:
        plan = _plan(status)
        previous = state.status_of(UID, body) or {}
        # apply reads the spec only to create pods: this plan creates none.
        await reconcile.apply(state, body, cast(Any, None), plan, LOG, previous)
        return plan

    await apply(_status())
    assert [w["readyReplicas"] for w in writes] == [1]
    held = await apply(_status(sources=2, loaded="40%"))
    assert len(writes) == 1  # progress: held...
    assert held.requeue_after <= STATUS_COALESCE_SECONDS  # ...and the pass comes back for it
    # The next pass plans from the held status (its sources included), not the written one.
    planned = (state.status_of(UID, body) or {})["sources"]
    assert [SourceEndpoint.model_validate(s).pod for s in planned] == ["p-0", "p-1"]
    state.deployment(UID).written_at = time.monotonic() - STATUS_COALESCE_SECONDS
    await apply(_status(sources=2, loaded="40%"))  # nothing new planned, the held write is due
    assert [w["loaded"] for w in writes] == ["25%", "40%"]
    await apply(_status("Ready", ready=4, sources=4))  # a phase: at once
    assert [w["phase"] for w in writes] == ["Loading", "Loading", "Ready"]
    assert not state.deployment(UID).pending
    monkeypatch.setattr(statuswrites, "STATUS_COALESCE_SECONDS", 0.0)
    await apply(_status("Ready", ready=4, sources=4, loaded="99%"))
    assert len(writes) == 4
    assert writes[-1]["phase"] == Phase.READY and writes[-1]["loaded"] == "99%"
