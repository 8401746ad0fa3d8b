"""Shared helpers for the p2p tests: processes that are always killed, and an in-thread source."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from weightlift.api.model import ChecksumSetting
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.local.sharded import make_plan
from weightlift.worker.p2p.nixl_compat import nixl_import_error
from weightlift.worker.p2p.source import SourcePublisher, p2p_app

PY = sys.executable
NIXL_MISSING = nixl_import_error()
# `make test` sets it: then a NIXL that does not import fails the NIXL tests instead of skipping.
REQUIRE_NIXL_ENV = "WEIGHTLIFT_REQUIRE_NIXL"


def require_nixl() -> None:
    """Skip the calling test when NIXL does not import here; fail it when
    WEIGHTLIFT_REQUIRE_NIXL is set."""
    if NIXL_MISSING is None:
        return
    msg = f"NIXL: {NIXL_MISSING}"
    if os.environ.get(REQUIRE_NIXL_ENV):
        pytest.fail(f"{msg} [{REQUIRE_NIXL_ENV} is set]", pytrace=False)
    pytest.skip(msg)


# For a test or a module (`pytestmark`): `require_nixl()` at the test's setup. A mark can only
# skip; but pytest evaluates a string condition then, in the test module's globals plus `sys`,
# and the skip or failure `require_nixl` raises (outcomes, not Exceptions) is the test's outcome.
needs_nixl = pytest.mark.skipif(
    f"sys.modules[{__name__!r}].require_nixl()", reason="NIXL does not import here"
)


class Proc:
    """A child process speaking JSON lines on stdout; killed on exit whatever happens."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [PY, "-m", "weightlift.bench.peer", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []

    def next_event(self, want: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.p.stdout is not None
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                err = self.p.stderr.read() if self.p.stderr else ""
                raise AssertionError(f"process exited before {want!r}: {err[-2000:]}")
            event = json.loads(line)
            self.events.append(event)
            if event["event"] == want:
                return event
        raise AssertionError(f"no {want!r} event within {timeout}s")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)


@contextmanager
def source_process(
    model_dir: Path,
    tmp: Path,
    *,
    pod: str = "src-0",
    identity: str = "ident-test",
    checksum: ChecksumSetting = "auto",
) -> Iterator[tuple[Proc, PeerCandidate]]:
    plan = make_plan(model_dir, pod=pod, identity=identity, checksum=checksum)
    path = tmp / f"{pod}-plan.json"
    path.write_text(plan.model_dump_json())
    proc = Proc(["serve", "--plan", str(path)])
    try:
        ready = proc.next_event("ready", timeout=90)
        yield proc, PeerCandidate(pod=pod, address=f"127.0.0.1:{ready['port']}")
    finally:
        proc.kill()


class ThreadSource:
    """A SourcePublisher served by aiohttp in a background thread of this process."""

    def __init__(self, plan: WorkerPlan, tensors_by_rank: dict[int, dict[str, torch.Tensor]]):
        self.publisher = SourcePublisher(plan, tensors_by_rank)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()

        async def run() -> None:
            self.runner = web.AppRunner(p2p_app(self.publisher), access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]
            started.set()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(run())
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert started.wait(30)
        self.candidate = PeerCandidate(pod=plan.pod_name, address=f"127.0.0.1:{self.port}")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.publisher.close()
