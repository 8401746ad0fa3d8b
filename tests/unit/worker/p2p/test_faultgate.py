"""The fault gate (worker/p2p/faultgate.py): the chaos harness holds one real pull open
mid-transfer, strikes, and releases it.

Covers: the gate is ignored off a local node and honoured on either kind, whose env no spec
can set; an arm is taken by one pod of its own
deployment only; a pull that ends before it held puts the arm back; a held pull over real NIXL
stops after its first READ with the rest to go, and then either finishes bit-equal once released
or, with its source SIGKILLed while held, fails naming that source (the worker's storage
fallback follows).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.p2p import needs_nixl, source_process
from weightlift.api.model import Role
from weightlift.local.sharded import make_plan
from weightlift.operator.planning import SpecError
from weightlift.operator.reconcile import parse_spec
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.p2p import faultgate
from weightlift.worker.p2p.target import PullOptions
from weightlift.worker.weights.progress import LoadError, LoadProgress

CPU = torch.device("cpu")
OPTS = PullOptions(transfer_timeout_s=5, stall_seconds=3, liveness_interval_s=0.25)


def test_ignored_outside_the_process_node(gate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    faultgate.arm(gate, "md")
    monkeypatch.delenv(faultgate.PROCESS_NODE_ENV)
    assert faultgate.claim("md-abc-1") is None
    assert (gate / "arm.md").exists()


def test_honoured_on_the_real_node(gate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real node's device plugin sets WEIGHTLIFT_LOCAL_NODE, not the process node's env."""
    monkeypatch.delenv(faultgate.PROCESS_NODE_ENV)
    monkeypatch.setenv(faultgate.LOCAL_NODE_ENV, "kubelet")
    assert faultgate.gate_dir() == gate
    faultgate.hold_at(gate, "md", faultgate.STORAGE_LOAD)
    faultgate.release_at(gate, "md", faultgate.STORAGE_LOAD)
    assert asyncio.run(faultgate.wait_at(faultgate.STORAGE_LOAD, "md-abc-1")) is False
    faultgate.hold_at(gate, "md", faultgate.STORAGE_LOAD)
    threading.Timer(0.3, faultgate.release_at, (gate, "md", faultgate.STORAGE_LOAD)).start()
    assert asyncio.run(faultgate.wait_at(faultgate.STORAGE_LOAD, "md-abc-1")) is True
    monkeypatch.delenv(faultgate.LOCAL_NODE_ENV)
    assert faultgate.gate_dir() is None


@pytest.mark.parametrize(
    "name", [faultgate.GATE_DIR_ENV, faultgate.PROCESS_NODE_ENV, faultgate.LOCAL_NODE_ENV]
)
def test_a_deployment_cannot_open_the_gate_itself(name: str) -> None:
    """The operator's pods get the gate's env from a local node only: a spec naming it is
    refused as the operator reads it (the CRD's CEL rule refuses it at admission too)."""
    raw = {"model": {"uri": "pvc://models/tiny"}, "template": {"env": [{"name": name}]}}
    got = parse_spec(raw)
    assert isinstance(got, SpecError) and "reserved for the worker" in got.message, got


def test_one_pod_of_the_armed_deployment_claims_it(gate: Path) -> None:
    faultgate.arm(gate, "md")
    assert faultgate.claim("md2-abc-1") is None  # another deployment's pod
    first = faultgate.claim("md-abc-1")
    assert first is not None and first.deployment == "md"
    assert faultgate.claim("md-abc-2") is None  # taken
    first.close()  # ended before it held: armed again for the next pull
    second = faultgate.claim("md-abc-2")
    assert second is not None
    faultgate.disarm(gate, "md")
    assert not list(gate.iterdir())


def _pull_in_thread(
    model_dir: Path, pod: str, address: str
) -> tuple[threading.Thread, dict[str, object], PeerToPeerLoader]:
    from weightlift.api.worker import PeerCandidate

    plan = make_plan(
        model_dir,
        pod="md-abc-1",
        role=Role.TARGET,
        peers=[PeerCandidate(pod=pod, address=address)],
        identity="ident-test",
    )
    loader = PeerToPeerLoader(options=OPTS)
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["tensors"] = loader.load(plan, 0, CPU, LoadProgress())
        except LoadError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out, loader


def _held(gate: Path, alive: Callable[[], bool]) -> faultgate.Held:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and alive():
        held = faultgate.holding(gate, "md")
        if held is not None:
            return held
        time.sleep(0.01)
    raise AssertionError("no pull held")


@needs_nixl
@pytest.mark.timeout(120)
def test_a_held_pull_waits_mid_transfer_then_finishes(
    gate: Path, model_dir: Path, tmp_path: Path
) -> None:
    with source_process(model_dir, tmp_path) as (_, cand):
        faultgate.arm(gate, "md")
        thread, out, loader = _pull_in_thread(model_dir, cand.pod, cand.address)
        held = _held(gate, thread.is_alive)
        assert held.pod == "md-abc-1" and held.peer == cand.pod and held.in_flight
        assert held.done == 1 and held.batches >= faultgate.GATED_READS
        time.sleep(1.0)  # held: longer than a stall would be allowed, nothing moves
        assert thread.is_alive() and faultgate.holding(gate, "md") == held
        faultgate.release(gate, held.pod)
        thread.join(60)
    want = load_file(str(model_dir / "rank-0-of-2.safetensors"))
    got = out["tensors"]
    assert isinstance(got, dict) and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert loader.last_result is not None and loader.last_result.batches == held.batches
    assert not list(gate.iterdir())  # the one arm is used up


@needs_nixl
@pytest.mark.timeout(120)
def test_a_source_killed_while_held_fails_the_pull(
    gate: Path, model_dir: Path, tmp_path: Path
) -> None:
    with source_process(model_dir, tmp_path, pod="doomed-0") as (proc, cand):
        faultgate.arm(gate, "md")
        thread, out, loader = _pull_in_thread(model_dir, cand.pod, cand.address)
        held = _held(gate, thread.is_alive)
        assert held.in_flight
        proc.kill()
        faultgate.release(gate, held.pod)
        thread.join(60)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), LoadError), out
    assert "peer doomed-0" in str(out["error"])
    assert loader.failures[0].kind in ("dead", "transfer", "stall")


# ------------------------------------------------------------------ holds at a step of the start


def test_a_step_holds_every_pod_of_its_deployment_until_released(gate: Path) -> None:
    """A pod reaching a held step waits (async: its front door keeps serving), says so in
    `at.<step>.<pod>`, and goes on once the harness releases the step; other deployments'
    pods and other steps pass straight through."""
    step = faultgate.STORAGE_LOAD

    async def scenario() -> None:
        assert await faultgate.wait_at(step, "md-abc-0") is False  # nothing held yet
        faultgate.hold_at(gate, "md", step)
        assert await faultgate.wait_at(step, "md2-abc-0") is False  # another deployment
        assert await faultgate.wait_at("other-step", "md-abc-0") is False
        first = asyncio.ensure_future(faultgate.wait_at(step, "md-abc-0"))
        second = asyncio.ensure_future(faultgate.wait_at(step, "md-abc-1"))
        for _ in range(500):
            if len(faultgate.waiting_at(gate, "md", step)) == 2:
                break
            await asyncio.sleep(0.01)
        waiting = faultgate.waiting_at(gate, "md", step)
        assert sorted(a.pod for a in waiting) == ["md-abc-0", "md-abc-1"]
        assert {a.pid for a in waiting} == {os.getpid()}
        await asyncio.sleep(0.2)  # held: a gate, not a delay
        assert not first.done() and not second.done()
        faultgate.release_at(gate, "md", step)
        assert await asyncio.wait_for(first, 5) is True
        assert await asyncio.wait_for(second, 5) is True
        assert faultgate.waiting_at(gate, "md", step) == []

    asyncio.run(scenario())
    assert not list(gate.iterdir())


def test_disarm_lets_a_held_step_go(gate: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = faultgate.STORAGE_LOAD
    faultgate.hold_at(gate, "md", step)

    async def waits() -> bool:
        return await faultgate.wait_at(step, "md-abc-0")

    async def scenario() -> bool:
        task = asyncio.ensure_future(waits())
        while not faultgate.waiting_at(gate, "md", step):
            await asyncio.sleep(0.01)
        faultgate.disarm(gate, "md")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) is True
    assert not list(gate.iterdir())
    faultgate.hold_at(gate, "md", step)
    monkeypatch.delenv(faultgate.PROCESS_NODE_ENV)  # not under the process node: never held
    assert asyncio.run(waits()) is False


def test_a_hold_narrowed_to_one_pod_keeps_it_and_lets_the_others_go(gate: Path) -> None:
    """The group-leader scenario: both pods of a group wait at GROUP_JOIN under the deployment's
    hold; the harness holds the leader alone and releases the deployment. The other pod goes on,
    the leader keeps waiting (never let go in between) until its own hold is released; a pod
    whose name only starts with the leader's (its group's pod `<leader>-1`) is not held by it."""
    step = faultgate.GROUP_JOIN
    leader, worker = "md-abc-0-0", "md-abc-0-0-1"

    async def scenario() -> None:
        faultgate.hold_at(gate, "md", step)
        first = asyncio.ensure_future(faultgate.wait_at(step, leader))
        second = asyncio.ensure_future(faultgate.wait_at(step, worker))
        while len(faultgate.waiting_at(gate, "md", step)) < 2:
            await asyncio.sleep(0.01)
        faultgate.hold_pod_at(gate, leader, step)
        faultgate.release_at(gate, "md", step)
        assert await asyncio.wait_for(second, 5) is True
        await asyncio.sleep(0.2)  # held: a gate, not a delay
        assert not first.done()
        assert [a.pod for a in faultgate.waiting_at(gate, "md", step)] == [leader]
        # Held alone, the leader's hold holds no other pod, not even one named after it.
        assert await faultgate.wait_at(step, worker) is False
        assert await faultgate.wait_at(faultgate.STORAGE_LOAD, leader) is False
        faultgate.release_pod_at(gate, leader, step)
        assert await asyncio.wait_for(first, 5) is True

    asyncio.run(scenario())
    assert not list(gate.iterdir())


def test_disarm_releases_a_pod_held_alone(gate: Path) -> None:
    step = faultgate.GROUP_JOIN

    async def scenario() -> bool:
        faultgate.hold_pod_at(gate, "md-abc-0-0", step)
        task = asyncio.ensure_future(faultgate.wait_at(step, "md-abc-0-0"))
        while not faultgate.waiting_at(gate, "md", step):
            await asyncio.sleep(0.01)
        faultgate.disarm(gate, "md")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) is True
    assert not list(gate.iterdir())
