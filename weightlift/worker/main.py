"""`weightlift worker`: the life of a worker, whatever engine serves the model.

Flow: the front door starts first (server.py: live and /weightlift/v1/status answer during the
load) -> s3:// and hf:// models are fetched into a local dir -> the engine `runtime.engine`
names (worker/engines) brings the model up: init hooks (fail-closed), weights, serving, P2P
publishing -> phase Serving, ready 200 -> serve until SIGTERM or the engine dies.
Builtin (engines/builtin): hooks, loads and the PT2 program in this process. vLLM
(engines/vllm): hooks, load and publish happen inside vLLM's rank processes (its `weightlift`
load format); the worker starts vLLM, is Ready when vLLM is, and fronts it. Triton
(engines/triton): the same vLLM inside a real tritonserver's Python backend.
SIGTERM/SIGINT: not ready, the engine closes (publisher, processes, hooks), exit 0.

On failure the phase is Failed with a message naming file/tensor/library/symbol and
`permanentFailure` true for bad files, missing symbols and program/weight mismatches. The worker
keeps answering /v2/health/live and /weightlift/v1/status (ready stays 503) for
WEIGHTLIFT_FAIL_LINGER_SECONDS (default 30) so the operator can read why, writes the message
to the termination log (/dev/termination-log or WEIGHTLIFT_TERMINATION_LOG), then exits 1.

A pod of a multi-pod replica (`podsPerReplica` > 1: a LeaderWorkerSet group, whose pods run
restartPolicy Always) narrows its plan to its own ranks (plan.group_place) and never exits on
a permanent failure: it keeps answering /weightlift/v1/status (Failed, permanentFailure) until
stopped, so it is never a silent crash loop. A broken group (a rank gone) exits 1 as above: the
container restarts and the operator recreates the group (counting it: maxGroupRestarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from aiohttp import web

from weightlift.api.worker import WorkerPhase, WorkerPlan, WorkerReport
from weightlift.worker.engines import create_engine
from weightlift.worker.engines.base import BringUp, Engine, in_daemon_thread, write_termination_log
from weightlift.worker.hooks import HookError
from weightlift.worker.loaders.strategy import wants_peer_to_peer
from weightlift.worker.p2p import faultgate
from weightlift.worker.peer_auth import RedactingFilter
from weightlift.worker.plan import GroupPlace, group_place, read_plan
from weightlift.worker.server import WorkerState, build_app
from weightlift.worker.standby import hand_off, handoff_path, starts_in_standby
from weightlift.worker.storage.fetch import is_remote, materialize
from weightlift.worker.weights.header import SafetensorsFormatError
from weightlift.worker.weights.progress import LoadProgress

if TYPE_CHECKING:
    from weightlift.worker.p2p.target import PullOptions

log = logging.getLogger("weightlift.worker")

# bench/p2p_worker.py reads the fallback moment from these lines' timestamps.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FAIL_LINGER_ENV = "WEIGHTLIFT_FAIL_LINGER_SECONDS"


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, SafetensorsFormatError):
        return True
    if isinstance(exc, HookError):
        return exc.permanent
    return bool(getattr(exc, "permanent", False))


def process_started() -> float | None:
    """When this process started (Unix seconds, 10 ms resolution), from /proc; None elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start, ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return round(time.time() - age, 3)


class Worker:
    """One worker process's life; `run()` returns the exit code. What serves the model is the
    engine's (worker/engines): this class starts the front door, fetches the model dir, brings
    the engine up, serves until stopped, and reports a failure."""

    def __init__(
        self,
        plan: WorkerPlan,
        stop: asyncio.Event | None = None,
        pull_options: PullOptions | None = None,
    ) -> None:
        self.plan = plan
        self.pull_options = pull_options
        self.state = WorkerState.for_plan(plan)
        self.stop = stop or asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.engine: Engine | None = None
        self.published = False  # bring-up done, its publish step included (source or not)
        self.group: GroupPlace | None = None
        started = process_started()
        if started is not None:
            self.state.report.timeline["process"] = started

    def _stamp(self, step: str) -> None:
        self.state.report.timeline[step] = round(time.time(), 3)

    async def start_server(self) -> web.Application:
        app = build_app(self.state)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.plan.host, self.plan.runtime.port)
        await site.start()
        log.info("serving on %s:%d", self.plan.host, self.plan.runtime.port)
        self._stamp("server")
        return app

    async def fetch_model(self, ctx: BringUp) -> None:
        """s3:// and hf://: download into a local dir (or take the node cache's verified copy)
        before the init hooks and the engine need it. A target that will pull its weights from
        a peer fetches only the small files; the engine gets the rest on a fallback."""
        if not is_remote(self.plan):
            return
        self.state.report.phase = WorkerPhase.LOADING
        progress = LoadProgress()
        ctx.fetch_started = progress.started
        # Progress from the first byte: the download counts as the first rank's load.
        self.state.progress = {self.plan.ranks[0]: progress}
        weights = not (wants_peer_to_peer(self.plan) or ctx.handoff_file is not None)
        fetch = functools.partial(materialize, self.plan, progress, weights=weights)
        ctx.fetched = await in_daemon_thread(fetch)
        for warning in ctx.fetched.warnings:
            log.warning("%s", warning)
        self.plan = self.plan.model_copy(update={"model_dir": ctx.fetched.model_dir})
        ctx.has_weights = weights

    async def _bring_up(self, app: web.Application) -> None:
        ctx = BringUp(state=self.state, app=app, pull_options=self.pull_options, group=self.group)
        path = handoff_path()
        if starts_in_standby(self.plan, path):
            ctx.handoff_file = path
        elif not wants_peer_to_peer(self.plan):
            # The local stack's harness may hold a storage load here (faultgate.py; local nodes
            # only): its faults then land before any replica can be Ready, not in a window.
            await faultgate.wait_at(faultgate.STORAGE_LOAD, self.plan.pod_name)
        await self.fetch_model(ctx)
        self._stamp("fetch")
        assert self.engine is not None
        if ctx.handoff_file is not None and not getattr(self.engine, "prepares_standby", False):
            # An engine that cannot prepare before its peers are known starts once they
            # are: made again with the handed plan.
            self.plan = await hand_off(self.state.report, ctx.handoff_file, self.plan)
            ctx.handoff_file = None
            self.engine = self.state.engine = create_engine(self.plan)
        await self.engine.bring_up(ctx)
        self.published = True

    def take_group_place(self) -> None:
        """A pod of a multi-pod replica: its own ranks from here on (GroupRefused otherwise)."""
        self.group = None
        self.plan, place = group_place(self.plan)
        if place is not None:
            self.group = place
            self.state.plan = self.plan
            self.state.report.ranks = list(self.plan.ranks)
            log.info(
                "pod %d of a %d-pod replica: ranks %s", place.index, place.size, self.plan.ranks
            )

    def prepare_staging(self) -> threading.Thread | None:
        """An engine that loads weights in this process (builtin) onto CUDA: allocate the
        pinned staging pool now, in a thread, beside the download and the init hooks, not
        inside the first load (loaders/staging.py). The thread, or None when not needed."""
        if not getattr(self.engine, "loads_in_process", False):
            return None
        from weightlift.worker.loaders.staging import prepare_staging

        return prepare_staging(self.plan)

    async def shutdown(self) -> None:
        self.state.ready = False
        if self.state.report.phase != WorkerPhase.FAILED:
            self.state.report.phase = WorkerPhase.STOPPING
        if self.engine is not None:
            await self.engine.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _fail(self, exc: Exception) -> None:
        rep = self.state.report
        if isinstance(exc, TimeoutError):
            msg = f"load did not finish within {self.plan.loading.load_timeout_seconds}s"
        else:
            msg = str(exc) or type(exc).__name__
        rep.phase = WorkerPhase.FAILED
        rep.message = msg
        rep.permanent_failure = is_permanent(exc)
        self.state.ready = False
        log.error("load failed (permanent=%s): %s", rep.permanent_failure, msg)
        write_termination_log(msg)

    async def run(self) -> int:
        app: web.Application | None = None
        rep = self.state.report
        stop_task = asyncio.ensure_future(self.stop.wait())
        try:
            # The front door first: a refused group place is reported, not a crash.
            app = await self.start_server()
            self.take_group_place()
            self.engine = self.state.engine = create_engine(self.plan)
            self.prepare_staging()
            work = asyncio.ensure_future(self._bring_up(app))
            done, _ = await asyncio.wait({work, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                if self.state.ready:
                    # Publishing as a P2P source (native NIXL code in a thread): let it finish,
                    # so shutdown closes it instead of exiting under it.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(work), timeout=30)
                else:
                    log.info("stop requested during %s; abandoning the load", rep.phase)
                    work.cancel()
                return 0
            work.result()
            log.info("serving %s (%s from %s)", rep.model, rep.strategy, rep.loaded_from)
            await self.engine.serve_until(stop_task)
            return 0
        except Exception as exc:
            self._fail(exc)
            if app is not None:
                linger: float | None = float(os.environ.get(FAIL_LINGER_ENV, "30") or 0)
                if rep.permanent_failure and (self.plan.pods_per_replica or 1) > 1:
                    linger = None  # restartPolicy Always: say why until stopped, never loop
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stop_task), timeout=linger)
            return 1
        finally:
            stop_task.cancel()
            await self.shutdown()


async def run_worker(
    plan: WorkerPlan,
    stop: asyncio.Event | None = None,
    pull_options: PullOptions | None = None,
) -> int:
    """Run a worker until `stop` is set (or SIGTERM/SIGINT when running in the main thread)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    try:
        return await Worker(plan, stop, pull_options).run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@click.command("worker")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="WorkerPlan JSON file (default: the operator's plan ConfigMap, see worker/plan.py).",
)
@click.option("--log-level", default="INFO", show_default=True)
def worker_command(plan_file: Path | None, log_level: str) -> None:
    """Run the model worker (init hooks, load, serve KServe v2)."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    try:
        plan = WorkerPlan.from_file(plan_file) if plan_file else read_plan()
    except Exception as exc:  # PlanRefused, pydantic's ValidationError, an unreadable file
        log.error("invalid worker plan: %s", exc)
        # A report, so the operator shows why and does not recreate the pod: another pod would
        # get the same plan.
        refused = WorkerReport(
            phase=WorkerPhase.FAILED,
            message=f"invalid worker plan: {exc}"[:2000],
            permanent_failure=True,
        )
        write_termination_log(refused.model_dump_json(by_alias=True))
        raise click.ClickException(f"invalid worker plan: {exc}") from exc
    bind_host = os.environ.get("WEIGHTLIFT_BIND_HOST")
    if bind_host:  # the local process node: this pod's 127.0.x.y stands in for its netns
        plan = plan.model_copy(update={"host": bind_host})
    raise SystemExit(asyncio.run(run_worker(plan)))
