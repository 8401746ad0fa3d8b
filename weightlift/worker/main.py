"""`weightlift worker`: start the server, run init hooks, load, bind, serve; stop on SIGTERM.

Flow: the HTTP server starts first (live and /weightlift/v1/status answer during the load) ->
init hooks per local rank/device (fail-closed) -> load every local rank concurrently, each the
way loaders/strategy.py picks (PeerToPeer with storage fallback, Preload or Direct) -> bind the
weights into model.pt2 -> phase Serving, ready 200 -> publish this replica as a P2P source
when the P2P module is importable.
With runtime.engine vLLM the hooks, load, bind and publish steps happen inside vLLM (its
`weightlift` load format, weightlift.worker.engines.vllm, in each rank's process): the worker
starts vLLM, is Ready when vLLM is, and fronts it (status, P2P manifest, /v1). vLLM exiting
fails the worker.
SIGTERM/SIGINT: not ready, close the publisher, release hooks, exit 0.

On failure the phase is Failed with a message naming file/tensor/library/symbol and
`permanentFailure` true for bad files, missing symbols and program/weight mismatches. The worker
keeps answering /v2/health/live and /weightlift/v1/status (ready stays 503) for
WEIGHTLIFT_FAIL_LINGER_SECONDS (default 30) so the operator can read why, writes the message
to the termination log (/dev/termination-log or WEIGHTLIFT_TERMINATION_LOG), then exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import torch
from aiohttp import web

from weightlift.api.model import Engine
from weightlift.api.storage import ModelUri
from weightlift.api.worker import HookReport, WorkerPhase, WorkerPlan, WorkerReport
from weightlift.worker.hooks import INIT_SYMBOL, HookError, InitHookSession, run_init_hooks
from weightlift.worker.loaders.base import Loader
from weightlift.worker.loaders.strategy import (
    choose_storage_loader,
    load_from_peers,
    wants_peer_to_peer,
)
from weightlift.worker.peer_auth import RedactingFilter, warn_if_open
from weightlift.worker.plan import read_plan
from weightlift.worker.runtime import BindError, Pt2Runtime
from weightlift.worker.server import WorkerState, build_app, set_p2p_handler
from weightlift.worker.storage.fetch import Fetched, is_remote, materialize
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.header import SafetensorsFormatError
from weightlift.worker.weights.progress import LoadError, LoadProgress

if TYPE_CHECKING:
    from weightlift.worker.p2p.target import PullOptions

log = logging.getLogger("weightlift.worker")

# bench/p2p_worker.py reads the fallback moment from these lines' timestamps.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FAIL_LINGER_ENV = "WEIGHTLIFT_FAIL_LINGER_SECONDS"
TERMINATION_LOG_ENV = "WEIGHTLIFT_TERMINATION_LOG"
T = TypeVar("T")


def resolve_devices(plan: WorkerPlan) -> dict[int, torch.device]:
    """rank -> device: "cpu"; "cuda" means cuda:r; "auto" is cuda when every rank has a GPU."""
    want = plan.device
    if want == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        want = "cuda" if n > 0 and max(plan.ranks, default=0) < n else "cpu"
    if want.startswith("cuda"):
        return {r: torch.device("cuda", r) for r in plan.ranks}
    return {r: torch.device("cpu") for r in plan.ranks}


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, SafetensorsFormatError | BindError):
        return True
    if isinstance(exc, HookError):
        return exc.permanent
    return bool(getattr(exc, "permanent", False))


def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
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


def process_started() -> float | None:
    """When this process started (Unix seconds, 10 ms resolution), from /proc; None elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start, ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return round(time.time() - age, 3)


def _write_termination_log(message: str) -> None:
    path = os.environ.get(TERMINATION_LOG_ENV, "/dev/termination-log")
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(message[:4000])


class Worker:
    """One worker process; `run()` returns the exit code."""

    def __init__(
        self,
        plan: WorkerPlan,
        stop: asyncio.Event | None = None,
        pull_options: PullOptions | None = None,
    ) -> None:
        self.plan = plan
        # Replaces the P2P options derived from the plan (benchmarks: READ size, a throttle).
        self.pull_options = pull_options
        self.state = WorkerState.for_plan(plan)
        self.stop = stop or asyncio.Event()
        self.hooks: InitHookSession | None = None
        self.publisher: Any = None
        self.runner: web.AppRunner | None = None
        self.published = False  # publish step done (whether or not a publisher was installed)
        self.engine: Any = None  # the VllmEngine when runtime.engine is vLLM
        self.devices = resolve_devices(plan)
        started = process_started()
        if started is not None:
            self.state.report.timeline["process"] = started
        # s3:// and hf://: what the download produced (None for mounted models).
        self.fetched: Fetched | None = None
        self.fetch_started: float | None = None
        self._weights_lock = threading.Lock()
        self._has_weights = not is_remote(plan)

    def _stamp(self, step: str) -> None:
        """The report's timeline: when `step` ended (wall clock, so the demo can line it up
        with what it saw of the pod)."""
        self.state.report.timeline[step] = round(time.time(), 3)

    # ------------------------------------------------------------------ steps
    async def start_server(self) -> web.Application:
        app = build_app(self.state)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.plan.host, self.plan.runtime.port)
        await site.start()
        log.info("serving on %s:%d", self.plan.host, self.plan.runtime.port)
        self._stamp("server")
        return app

    def _prewarm_p2p(self) -> None:
        """The first NIXL agent of a process costs ~0.5 s of library loading: pay it while the
        init hooks run, not inside the timed pull."""
        if not wants_peer_to_peer(self.plan):
            return
        try:
            from weightlift.worker.p2p.target import prewarm_nixl
        except ImportError:
            return
        prewarm_nixl()

    @property
    def storage_label(self) -> str:
        """loadedFrom for a storage load: storage:<scheme>, or cache (node-local cache hit)."""
        if self.fetched is not None:
            return self.fetched.loaded_from
        return f"storage:{ModelUri.parse(self.plan.model.uri).scheme}"

    async def fetch_model(self) -> None:
        """s3:// and hf://: download into a local dir (or take the node cache's verified copy)
        before the init hooks and the program need it. A target that will pull its weights from
        a peer fetches only the small files; `_ensure_weights` gets the rest on a fallback."""
        if not is_remote(self.plan):
            return
        self.state.report.phase = WorkerPhase.LOADING
        progress = LoadProgress()
        self.fetch_started = progress.started
        # Progress from the first byte: the download counts as the first rank's load.
        self.state.progress = {self.plan.ranks[0]: progress}
        weights = not wants_peer_to_peer(self.plan)
        fetch = functools.partial(materialize, self.plan, progress, weights=weights)
        self.fetched = await _in_daemon_thread(fetch)
        for warning in self.fetched.warnings:
            log.warning("%s", warning)
        self.plan = self.plan.model_copy(update={"model_dir": self.fetched.model_dir})
        self._has_weights = weights

    def _ensure_weights(self, progress: LoadProgress) -> None:
        """A remote target whose peers failed: download the weights once for all ranks."""
        with self._weights_lock:
            if self._has_weights:
                return
            self.fetched = materialize(self.plan, progress, weights=True)
            self.plan = self.plan.model_copy(update={"model_dir": self.fetched.model_dir})
            self._has_weights = True

    async def init_hooks(self) -> None:
        rep = self.state.report
        rep.phase = WorkerPhase.INIT_HOOKS
        self._prewarm_p2p()
        hooks = self.plan.init_hooks
        if hooks is not None:
            dev_indices = [r for r in self.plan.ranks]
            limit = self.plan.loading.load_timeout_seconds
            where = f"init hook {hooks.library} ({INIT_SYMBOL}, model dir {self.plan.model_dir})"
            # Native code can kill the process (a segfault) before Python can say anything: the
            # termination message names the library until the call returns.
            _write_termination_log(f"the worker died inside {where}")
            try:
                session: InitHookSession = await asyncio.wait_for(
                    _in_daemon_thread(run_init_hooks, hooks, self.plan.model_dir, dev_indices),
                    timeout=limit,
                )
                self.hooks = session
            except TimeoutError:
                # The thread stays stuck in native code; the process exits after the failure.
                exc = HookError(f"{where} did not return within {limit}s (loadTimeoutSeconds)")
                rep.hooks = [
                    HookReport(library=hooks.library, device_index=d, ok=False, message=str(exc))
                    for d in dev_indices
                ]
                raise exc from None
            except HookError as exc:
                rep.hooks = [
                    HookReport(library=hooks.library, device_index=d, ok=False, message=str(exc))
                    for d in dev_indices
                ]
                raise
            finally:
                _write_termination_log("")
            rep.hooks = list(session.reports)
        rep.hooks_run = True

    def _load_rank(self, rank: int, progress: LoadProgress) -> tuple[str, dict[str, torch.Tensor]]:
        """(strategy used, tensors) for one rank; runs in a thread."""
        dev = self.devices[rank]
        from_peer = load_from_peers(self.plan, rank, dev, progress, pull_options=self.pull_options)
        if from_peer is not None:
            return "p2p", from_peer
        self._ensure_weights(progress)
        plan = self.plan  # model_dir may have moved to the downloaded copy
        loader: Loader = choose_storage_loader(plan, self.devices)
        tensors = loader.load(plan, rank, dev, progress)
        progress.loaded_from = self.storage_label
        return loader.name, tensors

    async def load_and_bind(self) -> dict[int, dict[str, torch.Tensor]]:
        rep = self.state.report
        rep.phase = WorkerPhase.LOADING
        # The program opens beside the weight loads (both after the init hooks): opening it is
        # mostly torch.export's own imports (~2-3 s of CPU on first use), which the P2P READs
        # and file reads, out of the GIL, overlap.
        opening = asyncio.ensure_future(_in_daemon_thread(Pt2Runtime.open, self.plan.model_dir))
        for r in self.plan.ranks:
            # After a download the load's clock starts at its first byte, not at the preload.
            started = self.fetch_started
            self.state.progress[r] = (
                LoadProgress(started=started) if started is not None else LoadProgress()
            )
        jobs = [
            _in_daemon_thread(self._load_rank, r, self.state.progress[r]) for r in self.plan.ranks
        ]
        try:
            runtime, results = await asyncio.wait_for(
                asyncio.gather(opening, asyncio.gather(*jobs)),
                timeout=self.plan.loading.load_timeout_seconds,
            )
        finally:
            opening.cancel()  # a failed load need not wait for the program
        self._stamp("load")
        strategies = sorted({s for s, _ in results})
        rep.strategy = ",".join(strategies)
        sources = sorted(
            {self.state.progress[r].loaded_from or self.storage_label for r in self.plan.ranks}
        )
        rep.loaded_from = ",".join(sources)
        tensors_by_rank = {r: t for r, (_, t) in zip(self.plan.ranks, results, strict=True)}
        files_by_rank: dict[int, dict[str, str]] = {}
        for r in self.plan.ranks:
            try:
                idx = shard_index(self.plan.model_dir, r, self.plan.tensor_parallel)
                files_by_rank[r] = {n: h.path for n, (h, _) in idx.tensors.items()}
            except LoadError:
                files_by_rank[r] = {}
        bound = await _in_daemon_thread(
            runtime.bind, tensors_by_rank, files_by_rank, self.plan.model.dtype
        )
        self.state.runtime = runtime
        self._stamp("bind")
        return bound

    async def publish(
        self, bound: dict[int, dict[str, torch.Tensor]], app: web.Application
    ) -> None:
        try:
            from weightlift.worker.p2p.source import SourcePublisher
        except ImportError as exc:
            log.info("P2P source publishing unavailable: %s", exc)
            return
        try:
            self.publisher = await _in_daemon_thread(SourcePublisher, self.plan, bound)
        except Exception as exc:  # NIXL missing or failing: still serve, just not as a source
            log.warning("cannot publish as a P2P source: %s", exc)
            return
        set_p2p_handler(app, self.publisher)
        warn_if_open(self.state.peer_token)

    async def shutdown(self, app: web.Application | None) -> None:
        self.state.ready = False
        if self.state.report.phase != WorkerPhase.FAILED:
            self.state.report.phase = WorkerPhase.STOPPING
        if app is not None:
            set_p2p_handler(app, None)
        if self.publisher is not None:
            try:
                res = self.publisher.close()
                if inspect.isawaitable(res):
                    await res
            except Exception as exc:
                log.warning("closing the P2P publisher: %s", exc)
            self.publisher = None
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
        if self.hooks is not None:
            for problem in self.hooks.release():
                log.warning("init hook release: %s", problem)
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        app: web.Application | None = None
        rep = self.state.report
        stop_task = asyncio.ensure_future(self.stop.wait())
        try:
            app = await self.start_server()
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
            if self.engine is not None:
                await self.engine.serve_until(stop_task)
            else:
                await stop_task
            return 0
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                msg = f"load did not finish within {self.plan.loading.load_timeout_seconds}s"
            else:
                msg = str(exc) or type(exc).__name__
            rep.phase = WorkerPhase.FAILED
            rep.message = msg
            rep.permanent_failure = is_permanent(exc)
            self.state.ready = False
            log.error("load failed (permanent=%s): %s", rep.permanent_failure, msg)
            _write_termination_log(msg)
            if app is not None:
                linger = float(os.environ.get(FAIL_LINGER_ENV, "30") or 0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stop_task), timeout=linger)
            return 1
        finally:
            stop_task.cancel()
            await self.shutdown(app)

    async def _bring_up(self, app: web.Application) -> None:
        await self.fetch_model()
        self._stamp("fetch")
        if self.plan.runtime.engine == Engine.VLLM:
            from weightlift.worker.engines.vllm.engine import VllmEngine

            # The init hooks run inside vLLM, in each rank's process before its weights load
            # (the load format does it): a hook's per-device state must live where the rank's
            # device is driven, not in this front process.
            self.engine = VllmEngine.for_worker(self.plan)
            await self.engine.bring_up(self.state, app)
            self.published = True
            return
        await self.init_hooks()
        self._stamp("hooks")
        bound = await self.load_and_bind()
        for p in self.state.progress.values():
            if p.finished is None:
                p.finish()
        self.state.report.phase = WorkerPhase.SERVING
        self.state.ready = True
        self._stamp("serving")
        await self.publish(bound, app)
        self.published = True


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
        _write_termination_log(refused.model_dump_json(by_alias=True))
        raise click.ClickException(f"invalid worker plan: {exc}") from exc
    bind_host = os.environ.get("WEIGHTLIFT_BIND_HOST")
    if bind_host:  # the local process node: this pod's 127.0.x.y stands in for its netns
        plan = plan.model_copy(update={"host": bind_host})
    raise SystemExit(asyncio.run(run_worker(plan)))
