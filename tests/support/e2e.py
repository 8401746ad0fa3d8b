"""Helpers for the e2e tests: worker processes and deployments that must be gone."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from weightlift.local.kube import JSON
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


# The worker's liveness probe (10 s period, 6 failures: pods.py) kills a process stopped for
# ~70 s, as a kubelet would. On a loaded machine a target's vLLM takes longer than that to
# reach its weight step; a source frozen `keep_alive` is let run THAW_SECONDS in every
# FREEZE_SECONDS + THAW_SECONDS: one probe lands and passes, far too little time to load.
FREEZE_SECONDS, THAW_SECONDS = 35.0, 11.0


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _answers_live(pod: JSON) -> bool:
    ip = (pod.get("status") or {}).get("podIP")
    with contextlib.suppress(httpx.HTTPError):
        return bool(ip) and httpx.get(f"http://{ip}:8000/v2/health/live", timeout=1).is_success
    return False


@contextmanager
def frozen_source(stack: LocalStack, obs: Observer, keep_alive: bool = False) -> Iterator[str]:
    """Stop replica 0's worker process as soon as it exists (`keep_alive`: once its front door
    answers liveness, then thawed briefly now and then, see FREEZE_SECONDS); resume it on
    exit."""
    key: list[str] = []

    def started(o: Observer) -> bool:
        for pod in o.pods:
            if pod["metadata"]["labels"].get("weightlift.dev/replica") == "0":
                name = f"{stack.namespace}/{pod['metadata']['name']}"
                if stack.node.pids().get(name) and (not keep_alive or _answers_live(pod)):
                    key.append(name)
                    return True
        return False

    obs.wait(started, READY_TIMEOUT, "the source's worker process", interval=0.05)
    _signal_all(stack.node.pids()[key[0]], signal.SIGSTOP)
    done = threading.Event()

    def thaw_now_and_then() -> None:
        while not done.wait(FREEZE_SECONDS):
            _signal_all(stack.node.pids().get(key[0], []), signal.SIGCONT)
            if done.wait(THAW_SECONDS):
                return
            _signal_all(stack.node.pids().get(key[0], []), signal.SIGSTOP)

    thawing = threading.Thread(target=thaw_now_and_then, daemon=True)
    if keep_alive:
        thawing.start()
    try:
        yield key[0].split("/")[1]
    finally:
        done.set()
        if keep_alive:
            thawing.join()
        _signal_all(stack.node.pids().get(key[0], []), signal.SIGCONT)
