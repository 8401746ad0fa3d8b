"""What keeps the operator's API traffic flat at scale (measured by `weightlift bench operator`):
passes wait for pods they created to reach the index, probe times alone do not rewrite a status
every period, and one LIST of nodes serves every pass that needs it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, cast

import pytest

from weightlift.operator import kube, reconcile
from weightlift.operator.reconcile import OperatorState

UID = "3c1f7c3e-0000-4000-8000-000000000001"


def _state() -> OperatorState:
    # No clients: a test that reaches the API server fails on None.
    return OperatorState(core=cast(Any, None), custom=cast(Any, None), http=cast(Any, None))


def _body() -> dict[str, Any]:
    meta = {"name": "llama", "namespace": "ns", "uid": UID, "generation": 1}
    return {"metadata": meta, "spec": {"model": {"uri": "hostpath:///m"}, "replicas": 2}}


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": {}}, "status": {}}


async def test_a_pass_waits_for_pods_it_created_to_reach_the_index() -> None:
    state = _state()
    state.await_pod(UID, "llama-abc-0")
    log = logging.getLogger("test")
    # Not in the index yet: the pass returns before observing or writing anything.
    assert await reconcile.reconcile(state, _body(), [], [], log) == 1.0
    assert state.awaited_pods(UID, set()) == ["llama-abc-0"]
    # Indexed: nothing is awaited any more.
    assert state.awaited_pods(UID, {"llama-abc-0"}) == []
    assert UID not in state.awaited


def test_a_pod_that_never_shows_up_is_given_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    monkeypatch.setattr(reconcile, "CREATED_POD_WAIT_SECONDS", 0.0)
    state.await_pod(UID, "llama-abc-0")
    time.sleep(0.01)
    assert state.awaited_pods(UID, set()) == []


def _status(probe_time: str, latency: float, phase: str = "Ready") -> dict[str, Any]:
    probe = {"passed": True, "message": "ok", "lastProbeTime": probe_time, "latencyMs": latency}
    return {"phase": phase, "replicaStatuses": [{"name": "p-0", "probe": probe}, {"name": "p-1"}]}


def test_probe_times_alone_wait_for_the_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    before = _status("2026-01-01T00:00:00Z", 3.0)
    later = _status("2026-01-01T00:00:10Z", 4.5)
    # Never written by this operator: write.
    assert not reconcile._only_probe_times_moved(state, UID, later, before)
    state.written_at[UID] = time.monotonic()
    assert reconcile._only_probe_times_moved(state, UID, later, before)
    # Anything else that moved is written at once.
    moved = _status("2026-01-01T00:00:10Z", 4.5, phase="Degraded")
    assert not reconcile._only_probe_times_moved(state, UID, moved, before)
    failing = _status("2026-01-01T00:00:10Z", 4.5)
    failing["replicaStatuses"][0]["probe"]["passed"] = False
    assert not reconcile._only_probe_times_moved(state, UID, failing, before)
    # After the refresh period the probe times are written too.
    monkeypatch.setattr(reconcile, "PROBE_TIME_REFRESH_SECONDS", 0.0)
    assert not reconcile._only_probe_times_moved(state, UID, later, before)


async def test_one_node_list_serves_every_waiting_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    release = threading.Event()

    def list_nodes(core: Any, resource: str) -> int:
        calls.append(resource)
        release.wait(5)
        return 8

    monkeypatch.setattr(kube, "max_node_gpus", list_nodes)
    state = _state()
    waiting = [asyncio.ensure_future(state.max_node_gpus()) for _ in range(20)]
    await asyncio.sleep(0.1)
    release.set()
    assert await asyncio.gather(*waiting) == [8] * 20
    assert calls == ["nvidia.com/gpu"]
    assert await state.max_node_gpus() == 8 and len(calls) == 1  # cached now
