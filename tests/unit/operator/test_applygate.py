"""The apply gate (operator/applygate.py): a live test holds one pass between its first pod
creation and the rest, kills the operator there, and knows exactly which pods exist.

Covers: the gate is off without its env and in a pod; an arm is taken once, by its own
deployment; a held pass has created exactly its first pod and creates the rest once released;
an unarmed gate changes nothing; a hold ends by itself at its limit."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, cast

import pytest

from tests.support.planning import RecordedApi
from weightlift.operator import applygate, reconcile
from weightlift.operator.state import OperatorState

UID = "3c1f7c3e-0000-4000-8000-0000000000bb"
LOG = logging.getLogger("test")


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "gate"
    monkeypatch.setenv(applygate.GATE_DIR_ENV, str(folder))
    monkeypatch.delenv(applygate.IN_POD_ENV, raising=False)
    return folder


def _pass(replicas: int) -> Any:
    """One reconcile pass of deployment `md` with no pods yet: it creates `replicas` pods."""
    state = OperatorState(core=cast(Any, None), custom=cast(Any, None), http=cast(Any, None))
    meta = {"name": "md", "namespace": "ns", "uid": UID, "generation": 1}
    spec = {"model": {"uri": "pvc://models/md"}, "replicas": replicas,
            "loading": {"waitForSourceSeconds": 0}}  # fmt: skip
    return reconcile.reconcile(state, {"metadata": meta, "spec": spec}, [], lambda _: [], LOG)


def test_off_without_its_env_and_in_a_pod(gate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    applygate.arm(gate, "md")
    monkeypatch.setenv(applygate.IN_POD_ENV, "10.96.0.1")  # what the kubelet sets in a pod
    assert applygate.claim("md") is None
    monkeypatch.delenv(applygate.IN_POD_ENV)
    monkeypatch.delenv(applygate.GATE_DIR_ENV)
    assert applygate.claim("md") is None
    assert (gate / "arm.md").exists()


def test_an_arm_is_taken_once_by_its_own_deployment(gate: Path) -> None:
    applygate.arm(gate, "md")
    assert applygate.claim("md2") is None
    assert applygate.claim("md") == gate
    assert applygate.claim("md") is None
    assert list(gate.iterdir()) == []


async def test_a_held_pass_has_made_its_first_pod_only_until_released(
    gate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = RecordedApi(monkeypatch)
    applygate.arm(gate, "md")
    task = asyncio.ensure_future(_pass(3))
    while (held := applygate.holding(gate, "md")) is None:
        assert not task.done(), "the pass ended without holding"
        await asyncio.sleep(0.01)
    assert held.pid == os.getpid()
    assert held.created == api.names and len(api.names) == 1
    assert len(held.pending) == 2 and not set(held.pending) & set(held.created)
    await asyncio.sleep(0.2)  # held: nothing more is created, the event loop still runs
    assert api.names == held.created and not task.done()
    applygate.release(gate, "md")
    await asyncio.wait_for(task, 10)
    assert sorted(api.names) == sorted(held.created + held.pending)
    assert list(gate.iterdir()) == []


async def test_unarmed_the_pass_creates_everything_at_once(
    gate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = RecordedApi(monkeypatch)
    gate.mkdir()
    await asyncio.wait_for(_pass(3), 10)
    assert len(api.names) == 3
    assert list(gate.iterdir()) == []


async def test_a_hold_ends_at_its_limit(gate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(applygate, "HOLD_LIMIT_SECONDS", 0.1)
    gate.mkdir()
    held = applygate.Held("md", os.getpid(), ["md-a-0"], ["md-a-1"])
    await asyncio.wait_for(applygate.hold(gate, held), 5)
    assert applygate.holding(gate, "md") is None
