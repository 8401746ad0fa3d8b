"""Helpers for the e2e tests: worker processes and deployments that must be gone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack

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


@contextmanager
def frozen_source(stack: LocalStack, obs: Observer) -> Iterator[str]:
    """Stop replica 0's worker process as soon as it exists; resume it on exit."""
    key: list[str] = []

    def started(o: Observer) -> bool:
        for pod in o.pods:
            if pod["metadata"]["labels"].get("weightlift.dev/replica") == "0":
                name = f"{stack.namespace}/{pod['metadata']['name']}"
                if stack.node.pids().get(name):
                    key.append(name)
                    return True
        return False

    obs.wait(started, READY_TIMEOUT, "the source's worker process", interval=0.05)
    pids = stack.node.pids()[key[0]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield key[0].split("/")[1]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
