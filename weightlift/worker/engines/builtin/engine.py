"""The builtin engine: init hooks in the worker's process, each local rank's weights by the
strategy loaders/strategy.py picks (PeerToPeer with storage fallback, Preload or Direct), bound
into the model's PT2 program, served as KServe v2 infer, published as a P2P source.

A pod of a multi-pod replica (ctx.group) holds only its own ranks, waits for its hand-off
(role and leader) whatever its assignment says, joins its group once bound (group.py) and is
Ready only then; its leader serves inference across the group, a follower refuses it (421)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from weightlift.api.model import RankTransport
from weightlift.api.uri import ModelUri
from weightlift.api.worker import HookReport, WorkerPhase, WorkerPlan
from weightlift.worker.engines.base import (
    BringUp,
    in_daemon_thread,
    not_served,
    write_termination_log,
)
from weightlift.worker.engines.builtin.group import (
    Group,
    GroupBroken,
    GroupRunner,
    LeaderFailed,
    Member,
    leader_failure,
)
from weightlift.worker.engines.builtin.runtime import InferError, Pt2Runtime
from weightlift.worker.engines.builtin.v2codec import HEADER_LEN, decode_inputs, encode_outputs
from weightlift.worker.hooks import INIT_SYMBOL, HookError, InitHookSession, run_init_hooks
from weightlift.worker.loaders.base import Loader
from weightlift.worker.loaders.strategy import (
    choose_storage_loader,
    load_from_peers,
    wants_peer_to_peer,
)
from weightlift.worker.p2p import faultgate, reserve
from weightlift.worker.peer_auth import warn_if_open
from weightlift.worker.server import WorkerState, set_p2p_handler
from weightlift.worker.standby import receive_handoff, reserve_destination
from weightlift.worker.storage.fetch import materialize
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.progress import LoadError, LoadProgress

if TYPE_CHECKING:
    from weightlift.worker.p2p.source import SourcePublisher

log = logging.getLogger("weightlift.worker")

Bound = dict[int, dict[str, torch.Tensor]]


def resolve_devices(plan: WorkerPlan) -> dict[int, torch.device]:
    """rank -> device: "cpu"; "cuda" means the pod-local device index i (the pod's i-th
    visible GPU) for the pod's i-th rank, whatever the rank's number (a pod of a group holding
    ranks 2 and 3 drives its devices 0 and 1); "auto" is cuda when every local rank has a GPU."""
    want = plan.device
    if want == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        want = "cuda" if n > 0 and len(plan.ranks) <= n else "cpu"
    if want.startswith("cuda"):
        return {r: torch.device("cuda", i) for i, r in enumerate(plan.ranks)}
    return {r: torch.device("cpu") for r in plan.ranks}


class BuiltinEngine:
    """One replica's PT2 program and weights, in the worker's own process."""

    # Opens its program and faults in its pull buffers while it waits for peers (standby).
    prepares_standby = True
    # Loads the weights in the worker's process: the worker allocates the staging pool early.
    loads_in_process = True

    def __init__(self, plan: WorkerPlan) -> None:
        self.plan = plan
        self.devices = resolve_devices(plan)
        self.hooks: InitHookSession | None = None
        self.publisher: SourcePublisher | None = None
        self.runtime: Pt2Runtime | None = None
        self.ctx: BringUp | None = None
        self._weights_lock = threading.Lock()
        # A pod of a group: the hand-off's leader (host:port) and, once joined, the collectives.
        self.leader: str | None = None
        self.group: GroupRunner | None = None

    # ------------------------------------------------------------------ bring-up
    async def bring_up(self, ctx: BringUp) -> None:
        self.ctx = ctx
        if ctx.fetched is not None:
            self.plan = self.plan.model_copy(update={"model_dir": ctx.fetched.model_dir})
        await self.init_hooks(ctx.state)
        ctx.stamp("hooks")
        runtime = await self.stand_by(ctx) if ctx.handoff_file is not None else None
        bound = await self.load_and_bind(ctx, runtime)
        if runtime is not None:
            reserve.release()  # a buffer no pull took (its layout differed) is not kept
        for p in ctx.state.progress.values():
            if p.finished is None:
                p.finish()
        if ctx.group is not None:
            await self.join_group(ctx)
        ctx.state.report.phase = WorkerPhase.SERVING
        ctx.state.ready = True
        ctx.stamp("serving")
        await self.publish(bound, ctx.app, ctx.state)

    def _prewarm_p2p(self) -> None:
        """The first NIXL agent of a process loads NIXL's libraries (~0.07 s) and UCX's (plus its
        memory hooks, ~0.4 s, where RDMA devices need them), and the first dev64 on a GPU compiles
        its kernels: pay both while the init hooks run, not inside the timed pull."""
        standby = self.ctx is not None and self.ctx.handoff_file is not None
        if not (wants_peer_to_peer(self.plan) or standby):
            return
        try:
            from weightlift.worker.p2p.manifest import resolve_kind
            from weightlift.worker.p2p.target import prewarm_nixl
        except ImportError:
            return
        prewarm_nixl()
        # A CUDA target verifies dev64 on its GPU: compile the kernels now, not inside the pull.
        cuda = [d for d in self.devices.values() if d.type == "cuda"]
        if cuda and resolve_kind(self.plan.loading.peer_to_peer.checksum, cuda[0]) == "dev64":
            from weightlift.worker.p2p.devsum import prewarm

            prewarm(cuda[0])

    async def init_hooks(self, state: WorkerState) -> None:
        rep = state.report
        rep.phase = WorkerPhase.INIT_HOOKS
        self._prewarm_p2p()
        hooks = self.plan.init_hooks
        if hooks is not None:
            # The device index local to this pod: its i-th rank's (a pod of a group holds a
            # share of the ranks; a pod holding all of them, index = rank).
            dev_indices = list(range(len(self.plan.ranks)))
            limit = self.plan.loading.load_timeout_seconds
            where = f"init hook {hooks.library} ({INIT_SYMBOL}, model dir {self.plan.model_dir})"
            # Native code can kill the process (a segfault) before Python can say anything: the
            # termination message names the library until the call returns.
            write_termination_log(f"the worker died inside {where}")
            try:
                self.hooks = await asyncio.wait_for(
                    in_daemon_thread(run_init_hooks, hooks, self.plan.model_dir, dev_indices),
                    timeout=limit,
                )
            except (TimeoutError, HookError) as exc:
                # On a timeout the thread stays stuck in native code; the process exits after
                # the failure.
                failure = (
                    HookError(f"{where} did not return within {limit}s (loadTimeoutSeconds)")
                    if isinstance(exc, TimeoutError)
                    else exc
                )
                message = str(failure)
                rep.hooks = [
                    HookReport(library=hooks.library, device_index=d, ok=False, message=message)
                    for d in dev_indices
                ]
                if failure is exc:
                    raise
                raise failure from None
            finally:
                write_termination_log("")
            rep.hooks = list(self.hooks.reports)
        rep.hooks_run = True

    @property
    def storage_label(self) -> str:
        """loadedFrom for a storage load: storage:<scheme>, or cache (node-local cache hit)."""
        if self.ctx is not None and self.ctx.fetched is not None:
            return self.ctx.fetched.loaded_from
        return f"storage:{ModelUri.parse(self.plan.model.uri).scheme}"

    def _ensure_weights(self, progress: LoadProgress) -> None:
        """A remote target whose peers failed: download the weights once for all ranks."""
        assert self.ctx is not None
        with self._weights_lock:
            if self.ctx.has_weights:
                return
            self.ctx.fetched = materialize(self.plan, progress, weights=True)
            self.plan = self.plan.model_copy(update={"model_dir": self.ctx.fetched.model_dir})
            self.ctx.has_weights = True
            # The download showed as this rank's progress; the load that follows counts the
            # rank's shard (bytesLoaded = its own shard), on the clock the download started.
            started = progress.started
            progress.reset()
            progress.started = started

    def _load_rank(self, rank: int, progress: LoadProgress) -> tuple[str, dict[str, torch.Tensor]]:
        """(strategy used, tensors) for one rank; runs in a thread."""
        assert self.ctx is not None
        dev = self.devices[rank]
        if dev.type == "cuda":
            # Each rank loads in a thread of its own: make its current device the rank's, so
            # what a loader allocates, pins, streams or launches without naming a device lands
            # on this rank's GPU, not the pod's first.
            torch.cuda.set_device(dev)
        from_peer = load_from_peers(
            self.plan, rank, dev, progress, pull_options=self.ctx.pull_options
        )
        if from_peer is not None:
            return "p2p", from_peer
        self._ensure_weights(progress)
        plan = self.plan  # model_dir may have moved to the downloaded copy
        loader: Loader = choose_storage_loader(plan, self.devices)
        tensors = loader.load(plan, rank, dev, progress)
        progress.loaded_from = self.storage_label
        return loader.name, tensors

    def _start_progress(self, state: WorkerState, fetch_started: float | None) -> None:
        # After a download the load's clock starts at its first byte, not at the preload.
        for r in self.plan.ranks:
            state.progress[r] = (
                LoadProgress(started=fetch_started) if fetch_started is not None else LoadProgress()
            )

    async def stand_by(self, ctx: BringUp) -> Pt2Runtime:
        """Standby (worker/standby.py): open the program and fault in the pull buffers, then
        wait for the operator to hand peers or storage; returns the opened program."""
        assert ctx.handoff_file is not None
        runtime, reserved = await asyncio.gather(
            in_daemon_thread(Pt2Runtime.open, self.plan.model_dir),
            in_daemon_thread(reserve_destination, self.plan, self.devices),
        )
        log.info("standby: program open, %d bytes of pull buffers faulted in", reserved)
        self.plan, handoff = await receive_handoff(ctx.state.report, ctx.handoff_file, self.plan)
        self.leader = handoff.leader
        return runtime

    async def join_group(self, ctx: BringUp) -> None:
        """Join the group at the hand-off's leader; phase stays Loading until every pod has."""
        place, runtime = ctx.group, self.runtime
        assert place is not None and runtime is not None and self.leader is not None
        host = place.pod_ip or self.plan.host
        me = Member(place.index, self.plan.pod_name, f"{host}:{self.plan.runtime.port}")
        # The local stack's harness may hold a pod here (faultgate.py; local nodes only): its
        # group's other pods then wait for it in the rendezvous, where a fault strikes them.
        await faultgate.wait_at(faultgate.GROUP_JOIN, self.plan.pod_name)
        try:
            group = await in_daemon_thread(Group.join, place, self.leader, me)
        except GroupBroken as exc:
            why = None
            if not place.leader:
                why = await in_daemon_thread(leader_failure, self.leader, self.plan.runtime.port)
            if why is not None:
                raise LeaderFailed(
                    f"the group's leader at {self.leader} failed permanently: {why}"
                ) from exc
            raise
        self.group = GroupRunner(group, runtime).start()
        ctx.stamp("group")

    async def load_and_bind(self, ctx: BringUp, runtime: Pt2Runtime | None = None) -> Bound:
        state, rep = ctx.state, ctx.state.report
        rep.phase = WorkerPhase.LOADING
        # The program opens beside the weight loads (both after the init hooks): opening it is
        # mostly torch.export's own imports (~2-3 s of CPU on first use), which the P2P READs
        # and file reads, out of the GIL, overlap. A Target in standby opened it already.
        opening: asyncio.Future[Pt2Runtime]
        if runtime is None:
            opening = asyncio.ensure_future(in_daemon_thread(Pt2Runtime.open, self.plan.model_dir))
        else:
            opening = asyncio.get_running_loop().create_future()
            opening.set_result(runtime)
        self._start_progress(state, ctx.fetch_started)
        jobs = [in_daemon_thread(self._load_rank, r, state.progress[r]) for r in self.plan.ranks]
        try:
            opened, results = await asyncio.wait_for(
                asyncio.gather(opening, asyncio.gather(*jobs)),
                timeout=self.plan.loading.load_timeout_seconds,
            )
        finally:
            opening.cancel()  # a failed load need not wait for the program
        ctx.stamp("load")
        rep.strategy = ",".join(sorted({s for s, _ in results}))
        rep.loaded_from = ",".join(
            sorted({state.progress[r].loaded_from or self.storage_label for r in self.plan.ranks})
        )
        rep.transports = [
            RankTransport(rank=r, transport=p.transport, note=p.transport_note)
            for r, p in sorted(state.progress.items())
            if p.transport
        ]
        tensors_by_rank = {r: t for r, (_, t) in zip(self.plan.ranks, results, strict=True)}
        # A pod of a group binds its own ranks only.
        ranks = list(self.plan.ranks) if ctx.group is not None else None
        bound: Bound = await in_daemon_thread(
            opened.bind, tensors_by_rank, self._files_by_rank(), self.plan.model.dtype, ranks
        )
        self.runtime = opened
        ctx.stamp("bind")
        return bound

    def _files_by_rank(self) -> dict[int, dict[str, str]]:
        """rank -> tensor name -> the file it came from (bind names files in its errors)."""
        out: dict[int, dict[str, str]] = {}
        for r in self.plan.ranks:
            try:
                idx = shard_index(self.plan.model_dir, r, self.plan.tensor_parallel)
                out[r] = {n: h.path for n, (h, _) in idx.tensors.items()}
            except LoadError:
                out[r] = {}
        return out

    async def publish(self, bound: Bound, app: web.Application, state: WorkerState) -> None:
        try:
            from weightlift.worker.p2p.source import SourcePublisher
        except ImportError as exc:
            log.info("P2P source publishing unavailable: %s", exc)
            return
        try:
            self.publisher = await in_daemon_thread(SourcePublisher, self.plan, bound)
        except Exception as exc:  # NIXL missing or failing: still serve, just not as a source
            log.warning("cannot publish as a P2P source: %s", exc)
            return
        set_p2p_handler(app, self.publisher)
        warn_if_open(state.peer_token)

    async def serve_until(self, stop: asyncio.Future[Any]) -> None:
        if self.group is None:
            await stop
            return
        broken = asyncio.wrap_future(self.group.failed)
        await asyncio.wait({stop, broken}, return_when=asyncio.FIRST_COMPLETED)
        if broken.done() and not stop.done():
            broken.result()  # raises GroupBroken: the worker fails and exits

    async def close(self) -> None:
        if self.group is not None:
            self.group.stop()
        if self.ctx is not None:
            set_p2p_handler(self.ctx.app, None)
        if self.publisher is not None:
            try:
                self.publisher.close()
            except Exception as exc:
                log.warning("closing the P2P publisher: %s", exc)
            self.publisher = None
        if self.hooks is not None:
            for problem in self.hooks.release():
                log.warning("init hook release: %s", problem)
            self.hooks = None

    # ------------------------------------------------------------------ front door
    def metadata(self) -> dict[str, Any] | None:
        if self.runtime is None:
            return None
        return self.runtime.metadata(self.plan.served_model_name)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        assert self.ctx is not None and self.runtime is not None  # the front door checks Ready
        place = self.ctx.group
        if place is not None and not place.leader:
            leader = self.group.group.members[0].name() if self.group is not None else "rank 0"
            return web.json_response(
                {
                    "error": f"pod {place.index} of a group of {place.size}: send inference to "
                    f"the group leader, {leader}"
                },
                status=421,
            )
        state, name, runtime = self.ctx.state, self.plan.served_model_name, self.runtime
        t0 = time.perf_counter()
        try:
            body = await request.read()
            hl = request.headers.get(HEADER_LEN)
            try:
                header_len = int(hl) if hl is not None else None
            except ValueError:
                raise InferError(f"{HEADER_LEN} is not an integer: {hl!r}") from None
            req, arrays = decode_inputs(body, header_len)
            loop = asyncio.get_running_loop()
            async with state.infer_lock:
                if self.group is not None:
                    args = runtime.inputs_of(arrays)
                    flat = await asyncio.wrap_future(self.group.submit(args))
                    outputs = runtime.outputs_of(flat)
                else:
                    outputs = await loop.run_in_executor(None, runtime.infer, arrays)
            resp = encode_outputs(name, req, outputs)
        except InferError as exc:
            state.metrics.requests.labels(name, "bad_request").inc()
            return web.json_response({"error": str(exc)}, status=400)
        except GroupBroken as exc:
            state.metrics.requests.labels(name, "error").inc()
            return web.json_response({"error": str(exc)}, status=503)
        state.metrics.requests.labels(name, "ok").inc()
        state.metrics.latency.labels(name).observe(time.perf_counter() - t0)
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        m = self.plan.served_model_name
        return not_served(f"model {m!r} does not generate text (a builtin PT2 program)")

    async def openai(self, request: web.Request) -> web.StreamResponse:
        return not_served("this worker serves no OpenAI API (runtime.engine is Builtin)")
