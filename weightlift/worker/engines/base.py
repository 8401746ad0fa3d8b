"""The one interface every engine implements: builtin (PT2 program), vLLM (Triton next).

A worker's life (worker/main.py) is the same whatever serves the model: start the front door,
fetch the model dir, `bring_up` the engine, serve until stopped, `close`. The engine owns what
differs: where the init hooks run, how the weights arrive, when the model answers, what it
publishes as a P2P source, and the model routes of the front door (server.EngineFront).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from weightlift.worker.server import EngineFront, WorkerState

if TYPE_CHECKING:
    from weightlift.worker.p2p.target import PullOptions
    from weightlift.worker.plan import GroupPlace
    from weightlift.worker.storage.fetch import Fetched

TERMINATION_LOG_ENV = "WEIGHTLIFT_TERMINATION_LOG"
T = TypeVar("T")


@dataclass
class BringUp:
    """What the worker hands an engine to bring the model up."""

    state: WorkerState
    app: web.Application
    # s3:// and hf://: what the download produced (None for mounted models); `has_weights` is
    # False when only the small files came (a target that means to pull from a peer).
    fetched: Fetched | None = None
    has_weights: bool = True
    # When the download began: a load's clock starts at its first byte.
    fetch_started: float | None = None
    # Replaces the P2P options derived from the plan (benchmarks: READ size, a throttle).
    pull_options: PullOptions | None = None
    # A Target created before any source was Ready: its hand-off file (worker/standby.py), to
    # wait on once everything that needs no weights is done. None: no standby.
    handoff_file: Path | None = None
    # A pod of a multi-pod replica: its place in the group (plan.group_place); None otherwise.
    group: GroupPlace | None = None

    def stamp(self, step: str) -> None:
        """The report's timeline: when `step` ended (wall clock, so the demo can line it up
        with what it saw of the pod)."""
        self.state.report.timeline[step] = round(time.time(), 3)


class Engine(EngineFront, Protocol):
    """How a worker pod serves its model."""

    async def bring_up(self, ctx: BringUp) -> None:
        """Init hooks, weights, serving: return once the model answers (state.ready is set)
        and, where it can, after publishing this replica as a P2P source."""
        ...

    async def serve_until(self, stop: asyncio.Future[Any]) -> None:
        """Until `stop` completes; raise when the engine dies first."""
        ...

    async def close(self) -> None:
        """Unpublish, stop the engine's processes, release the init hooks (idempotent)."""
        ...


def not_served(what: str) -> web.Response:
    """The front door's answer for a model route this engine does not serve."""
    return web.json_response({"error": what}, status=404)


def in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run `fn` in a daemon thread: a SIGTERM during a long load does not wait for it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            res: T | None = fn(*args)
            err: BaseException | None = None
        except BaseException as exc:
            res, err = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, res, err)

    threading.Thread(target=run, daemon=True, name=f"wl-{getattr(fn, '__name__', 'task')}").start()
    return fut


def write_termination_log(message: str) -> None:
    """The pod's termination message (what `kubectl describe` shows after the container dies)."""
    path = os.environ.get(TERMINATION_LOG_ENV, "/dev/termination-log")
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(message[:4000])
