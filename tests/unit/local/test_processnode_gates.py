"""The process node computes a pod's Ready as the kubelet does (KEP-580): its containers ready
AND every readiness gate's condition True, as a controller set it on the pod. Runs in ~0.1 s."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from weightlift.local.processnode import NodeConfig, PodRunner
from weightlift.local.processnode.base import ContainerRun

GATE = "weightlift.dev/inference-probe"


def _pod(gate: str | None, gates: bool = True) -> dict[str, Any]:
    conditions = [{"type": GATE, "status": gate}] if gate is not None else []
    return {
        "metadata": {"name": "w-0", "namespace": "ns", "uid": "uid-0"},
        "spec": {
            "containers": [{"name": "worker"}],
            **({"readinessGates": [{"conditionType": GATE}]} if gates else {}),
        },
        "status": {"conditions": conditions},
    }


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[PodRunner]:
    node: Any = SimpleNamespace(
        config=NodeConfig(name="n", state_dir=tmp_path), host_ip="127.0.0.1"
    )
    run = PodRunner(node, _pod(None), "127.0.9.9")
    proc = subprocess.Popen(["sleep", "30"])
    container = ContainerRun(spec={"name": "worker"}, log_path=tmp_path / "log", proc=proc)
    container.readiness.ok = True  # its readiness probe passed
    run.containers = [container]
    yield run
    proc.kill()
    proc.wait()


def _conditions(runner: PodRunner) -> dict[str, tuple[str, str | None]]:
    return {c["type"]: (c["status"], c.get("reason")) for c in runner._status()["conditions"]}


def test_ready_waits_for_the_gate_its_containers_do_not(runner: PodRunner) -> None:
    shown = _conditions(runner)
    assert shown["ContainersReady"] == ("True", None)
    assert shown["Ready"] == ("False", "ReadinessGatesNotReady")  # no condition yet: False
    runner.update(_pod("False"))
    assert _conditions(runner)["Ready"] == ("False", "ReadinessGatesNotReady")
    runner.update(_pod("True"))  # the operator's probe passed
    assert _conditions(runner)["Ready"] == ("True", None)
    runner.update(_pod("False"))  # ...and failed again
    assert _conditions(runner)["Ready"] == ("False", "ReadinessGatesNotReady")


def test_a_pod_without_gates_is_ready_with_its_containers(runner: PodRunner) -> None:
    runner.update(_pod(None, gates=False))
    assert _conditions(runner)["Ready"] == ("True", None)
