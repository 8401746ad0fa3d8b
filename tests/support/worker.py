"""Helpers for the worker unit tests (imported by conftest and tests)."""

from __future__ import annotations

from weightlift.local.net import free_port

__all__ = ["free_port"]

import asyncio
import json
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    PLAN_CONFIGMAP_ENV,
    PLAN_FILE_ENV,
    PLAN_SHA256_ENV,
    WorkerPlan,
    plan_digest,
)
from weightlift.worker.main import Worker


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def pad_header(path: Path, residue: int) -> None:
    """Pad a safetensors file's JSON header with spaces (the format allows it) so its data
    section starts at `residue` mod 64: real files start wherever their 8-byte padded header
    ends, and every load path must place tensors as a mapping of the file does."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].rstrip(b" ")
    pad = (residue - 8 - len(header)) % 64
    path.write_bytes(struct.pack("<Q", len(header) + pad) + header + b" " * pad + raw[8 + n :])


def make_plan(model_dir: Path, tp: int = 1, **extra: Any) -> WorkerPlan:
    doc: dict[str, Any] = {
        "deployment": "demo",
        "podName": "demo-0",
        "modelIdentity": "id-123",
        "model": {"uri": f"file://{model_dir}"},
        "modelDir": str(model_dir),
        "servedModelName": "demo",
        "tensorParallel": tp,
        "ranks": list(range(tp)),
        "device": "cpu",
        "host": "127.0.0.1",
        "runtime": {"port": free_port()},
    }
    doc.update(extra)
    return WorkerPlan.model_validate(doc)


def plan_env(plan: WorkerPlan, folder: Path, configmap: str = "md-plan-test") -> dict[str, str]:
    """The environment (and plan file) the operator gives a worker pod: the shared plan in a
    file standing in for the ConfigMap, its sha256, and the per-replica assignment."""
    shared, assignment = plan.split()
    text = shared.to_text()
    path = folder / "plan.json"
    path.write_text(text)
    return {
        PLAN_FILE_ENV: str(path),
        PLAN_SHA256_ENV: plan_digest(text),
        PLAN_CONFIGMAP_ENV: configmap,
        ASSIGNMENT_ENV: assignment.to_text(),
    }


class RunningWorker:
    def __init__(self, plan: WorkerPlan) -> None:
        self.plan = plan
        self.url = f"http://127.0.0.1:{plan.runtime.port}"
        self.exit_code: int | None = None
        self.worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def go() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.worker = Worker(self.plan, self._stop)
            self._started.set()
            return await self.worker.run()

        self.exit_code = asyncio.run(go())

    def start(self) -> RunningWorker:
        self.thread.start()
        self._started.wait(10)
        return self

    def stop(self, timeout: float = 20) -> int | None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout)
        return self.exit_code

    def wait_phase(self, phases: set[str], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = httpx.get(self.url + "/weightlift/v1/status", timeout=2).json()
                if last.get("phase") in phases:
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"phase never reached {phases}; last status {json.dumps(last)}")


@contextmanager
def running_worker(plan: WorkerPlan) -> Iterator[RunningWorker]:
    w = RunningWorker(plan).start()
    try:
        yield w
    finally:
        w.stop()
