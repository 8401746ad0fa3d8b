"""The per-deployment loop leaves the gauges when it ends, however it ends: kopf stops a deleted
deployment's loop gracefully, or cancels it `cancellation_timeout` later when a pass still runs
(waiting for its turn, or on a probe of a worker that is going away). A cancelled loop that kept
its phases counted made `weightlift_deployments` count a deployment deleted long ago."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf
import pytest
from prometheus_client import CollectorRegistry

from weightlift.operator import handlers
from weightlift.operator.metrics import Metrics
from weightlift.operator.state import OperatorState

UID = "md-uid"


class Stopped:
    """kopf's DaemonStopped as the loop uses it: falsy until set, awaitable."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self) -> None:
        await self.flag.wait()


def _gauge(state: OperatorState) -> float:
    got = state.metrics.registry.get_sample_value("weightlift_deployments", {"phase": "Ready"})
    return 0.0 if got is None else got


async def _start(
    monkeypatch: pytest.MonkeyPatch, pass_blocks: bool
) -> tuple[OperatorState, Stopped, asyncio.Task[None]]:
    """A loop whose pass counts the deployment Ready, then blocks (or returns a long delay)."""
    none = cast(Any, None)
    state = OperatorState(
        core=none, custom=none, http=none, metrics=Metrics(CollectorRegistry(), process=False)
    )
    counted = asyncio.Event()

    async def reconcile(state: OperatorState, *_: Any) -> float:
        state.metrics.count_phases(UID, {"Ready": 1}, "Ready")
        counted.set()
        if pass_blocks:
            await asyncio.Event().wait()  # a probe that never answers
        return 3600.0

    monkeypatch.setattr(handlers, "reconcile", reconcile)
    stopped = Stopped()
    body = kopf.Body({"metadata": {"name": "m", "namespace": "ns", "uid": UID}})
    loop = handlers.reconcile_loop(
        body=body,
        namespace="ns",
        uid=UID,
        stopped=cast(Any, stopped),
        memo={"state": state},
        logger=handlers.log,
        published_sources={},
        pods_by_owner={},
    )
    task = asyncio.ensure_future(loop)
    await asyncio.wait_for(counted.wait(), 10)
    assert _gauge(state) == 1
    return state, stopped, task


async def test_a_loop_stopped_between_passes_leaves_the_gauges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, stopped, task = await _start(monkeypatch, pass_blocks=False)
    stopped.flag.set()
    await asyncio.wait_for(task, 10)
    assert _gauge(state) == 0
    assert UID not in state.deployments


async def test_a_loop_cancelled_mid_pass_leaves_the_gauges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, stopped, task = await _start(monkeypatch, pass_blocks=True)
    stopped.flag.set()  # kopf asks it to stop; the pass does not end, so kopf cancels it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _gauge(state) == 0
    assert UID not in state.deployments
