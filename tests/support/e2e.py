"""Helpers for the e2e tests: worker processes and deployments that must be gone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.cluster import wait_for
from weightlift.local.stack import LocalStack
from weightlift.worker.p2p import faultgate

READY_TIMEOUT = 240.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(stack: LocalStack, name: str, pids: list[int], timeout: float = 90.0) -> None:
    """No ModelDeployment, no pod and no worker process of `name` is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_operator()
        if (
            stack.get_md(name) is None
            and not stack.pods(name)
            and not any(alive(p) for p in pids)
            and not any(k.split("/")[1].startswith(f"{name}-") for k in stack.node.pids())
        ):
            return
        time.sleep(0.25)
    raise AssertionError(
        f"{name} not gone after {timeout}s: md={stack.get_md(name) is not None} "
        f"pods={[p['metadata']['name'] for p in stack.pods(name)]} "
        f"alive={[p for p in pids if alive(p)]}"
    )


def pids_of(stack: LocalStack, name: str) -> list[int]:
    return [
        pid
        for key, pids in stack.node.pids().items()
        if key.split("/")[1].startswith(f"{name}-")
        for pid in pids
    ]


def fault_gate(stack: LocalStack) -> Path:
    """The node's fault gate (worker/p2p/faultgate.py), either kind: where a test holds its
    workers at a known step instead of racing them."""
    return stack.node.fault_gate_dir


class SourceHold:
    """A deployment's storage loads held at the fault gate (see `held_source`)."""

    def __init__(self, stack: LocalStack, name: str) -> None:
        self.gate, self.name = fault_gate(stack), name

    def pod(self, timeout: float = READY_TIMEOUT) -> str:
        """The source, once it waits before its load (its front door up: liveness passes)."""
        step = faultgate.STORAGE_LOAD
        waiting = wait_for(
            lambda: faultgate.waiting_at(self.gate, self.name, step),
            timeout,
            f"{self.name}'s source held before its load",
            interval=0.05,
        )
        return waiting[0].pod


@contextmanager
def held_source(stack: LocalStack, name: str) -> Iterator[SourceHold]:
    """Deploy `name` inside the block: its source waits before its storage load until the block
    ends (then loads), alive and answering its probes, so what must come first (a target's
    Standby) comes first on any machine, with no window to catch."""
    gate = fault_gate(stack)
    faultgate.hold_at(gate, name, faultgate.STORAGE_LOAD)
    try:
        yield SourceHold(stack, name)
    finally:
        faultgate.release_at(gate, name, faultgate.STORAGE_LOAD)
