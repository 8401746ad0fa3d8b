"""The weightlift worker's side of a vLLM replica: start vLLM, watch it, report, front it.

The worker stays the pod's front door on `runtime.port` (status, P2P, probes) and runs vLLM's
OpenAI server on `runtime.enginePort` as a child process with `--load-format weightlift`. The
load format (in vLLM's process, see `loader`) writes one report per rank; the worker folds them
into its WorkerReport, is Ready when vLLM's /health answers, forwards /weightlift/v1/p2p/* to the
manifest server of the vLLM rank the request names (where that rank's NIXL agent and memory
are), /v1/* to vLLM, and answers Triton's `/v2/models/{m}/generate` through vLLM's
/v1/completions. Its /metrics carries vLLM's `vllm:*` series, labelled with the replica
(`metrics_text`).

The engine's Python: `WEIGHTLIFT_VLLM_PYTHON` (an environment with vLLM and weightlift, e.g. the
one `hack/install-vllm.sh` builds), else this interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from weightlift.api.model import RankTransport, Role
from weightlift.api.worker import WorkerPhase, WorkerPlan, WorkerReport
from weightlift.worker.engines.base import BringUp, not_served
from weightlift.worker.engines.exposition import relabel, replica_labels
from weightlift.worker.engines.vllm.compile_cache import CompileCache
from weightlift.worker.engines.vllm.compile_stores import open_stores
from weightlift.worker.engines.vllm.plugin import DIE_WITH_PARENT_ENV
from weightlift.worker.engines.vllm.ranks import (
    LOAD_FORMAT,
    RELAY_MARGIN_SECONDS,
    EngineLoadOptions,
    EngineRankReport,
    check_model_dir,
    compiles_before_weights,
    holds_weights,
    read_report,
)
from weightlift.worker.engines.vllm.serve import NOT_INSTALLED_EXIT
from weightlift.worker.server import set_p2p_handler
from weightlift.worker.standby import apply_handoff, wait_for_handoff, wait_limit
from weightlift.worker.weights.progress import LoadError

log = logging.getLogger(__name__)

PYTHON_ENV = "WEIGHTLIFT_VLLM_PYTHON"
# Where vLLM's plan, rank reports and log go (one folder per pod); default: a new temp folder.
WORKDIR_ENV = "WEIGHTLIFT_ENGINE_DIR"
# Lines of vLLM's log kept for the failure message.
LOG_TAIL_LINES = 30
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
# vLLM reads its API key from here (as --api-key); the worker's forwarder sends it.
API_KEY_ENV = "VLLM_API_KEY"


class EngineFailed(LoadError):
    """vLLM exited or never became healthy; the message carries its reason or its log's tail."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def engine_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def vllm_command(
    plan: WorkerPlan, plan_file: Path, report_dir: Path, handoff: Path | None = None
) -> list[str]:
    return [
        engine_python(),
        "-m",
        "weightlift.worker.engines.vllm.serve",
        "--host",
        engine_host(plan.host),
        "--port",
        str(plan.runtime.engine_port),
        *engine_args(plan, plan_file, report_dir, handoff),
    ]


def engine_args(
    plan: WorkerPlan, plan_file: Path, report_dir: Path, handoff: Path | None = None
) -> list[str]:
    """vLLM's engine arguments for the plan's model with weightlift's load format, as `vllm
    serve` takes them (vLLM's own server and the one inside Triton alike); the user's last."""
    options = EngineLoadOptions(
        plan=str(plan_file),
        report_dir=str(report_dir),
        handoff=str(handoff) if handoff else None,
        compile_first=handoff is not None and compiles_before_weights(os.environ, plan),
    )
    return [
        "--model",
        plan.model_dir,
        "--served-model-name",
        plan.served_model_name,
        "--tensor-parallel-size",
        str(plan.tensor_parallel),
        "--load-format",
        LOAD_FORMAT,
        "--model-loader-extra-config",
        json.dumps(options.wire()),
        *plan.runtime.engine_args,
    ]


def engine_host(host: str) -> str:
    """Where vLLM listens: the pod's loopback when the worker binds every address (a real pod's
    netns: nobody outside the pod reaches vLLM); else the worker's own address (the process node
    gives each pod one 127.0.x.y and no netns, so the API key below is what keeps others out)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def vllm_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    if plugins and LOAD_FORMAT not in plugins:  # an allow-list that would drop our load format
        env["VLLM_PLUGINS"] = ",".join([*plugins, LOAD_FORMAT])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env[DIE_WITH_PARENT_ENV] = "1"  # every vLLM process arms it in plugin.register()
    env.pop(PYTHON_ENV, None)
    root = checkout_root()
    if root is not None:
        # vLLM's processes import the weightlift this worker runs: the engine's environment may
        # be another venv whose editable install names another checkout (one shared per
        # machine), or one since deleted; PYTHONPATH goes before every .pth file's finder.
        front = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *front]))
    return env


def checkout_root() -> str | None:
    """The source checkout this weightlift runs from (pyproject.toml beside the package), or
    None when it is installed (an image's site-packages, which must not go ahead of the
    standard library on PYTHONPATH)."""
    root = Path(__file__).resolve().parents[4]
    return str(root) if (root / "pyproject.toml").is_file() else None


class VllmEngine:
    """One vLLM process for one replica (all its tensor-parallel ranks)."""

    label = "vLLM"  # what messages call the engine
    health_paths: tuple[str, ...] = ("/health",)  # all answer 200: the engine serves
    # The engine's own Prometheus families the worker's /metrics re-exports (`metrics_text`):
    # vLLM's, not the Python process and HTTP families its /metrics also serves.
    metrics_prefixes: tuple[str, ...] = ("vllm:",)
    # vLLM 0.32 serves /metrics without its API key; the key goes along in case a vLLM guards
    # it. Never to another server (Triton's metrics port).
    metrics_with_key = True
    # Standby (worker/standby.py): vLLM starts at once and builds the model; its weight step
    # waits for the hand-off the worker relays (`relay_handoff`).
    prepares_standby = True

    def __init__(self, plan: WorkerPlan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.report_dir = workdir / "reports"
        self.log_path = workdir / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"http://{engine_host(plan.host)}:{plan.runtime.engine_port}"
        self.metrics_url = self.url + "/metrics"
        # Only the worker holds it: vLLM's /v1 answers 401 to anyone who skips the worker's
        # Ready gate. Passed in the environment, so it is not on vLLM's command line.
        self.api_key = secrets.token_urlsafe(32)
        self._session: aiohttp.ClientSession | None = None
        self.started_at = 0.0
        self.app: web.Application | None = None
        self.compile_cache = CompileCache(plan, workdir, engine_python(), open_stores())
        self.log_offset = 0  # where this start's lines begin in vllm.log
        # Standby: where the ranks' weight step waits for the relayed hand-off (None: no wait).
        self.relay_file: Path | None = None

    # -------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        cmd = vllm_command(self.plan, self._write_plan(), self.report_dir, self.relay_file)
        log.info("starting vLLM: %s", " ".join(cmd))
        self._spawn(cmd, {**vllm_environment(), API_KEY_ENV: self.api_key})

    def _write_plan(self) -> Path:
        """The plan file the engine's ranks read (its load format runs in their processes)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        plan_file = self.workdir / "plan.json"
        plan_file.write_text(self.plan.model_dump_json(by_alias=True))
        return plan_file

    def _spawn(self, cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        """Start the engine's process, its output appended to this engine's log, with vLLM's
        compile cache root (a target's fetched one) in its environment."""
        self.started_at = time.monotonic()
        with self.log_path.open("ab") as out:
            self.log_offset = out.tell()
            self.process = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, **self.compile_cache.env()},
                cwd=cwd,
                # Same process group as the worker: whoever kills the pod's group kills the engine
                # too; and the engine dies with the worker if the worker is killed alone.
                preexec_fn=_die_with_parent,
            )

    def reports(self) -> list[EngineRankReport]:
        found = [read_report(self.report_dir, r) for r in range(self.plan.tensor_parallel)]
        return [r for r in found if r is not None]

    def _failure(self, what: str) -> EngineFailed:
        failed = [r for r in self.reports() if not r.ok]
        if failed:
            return EngineFailed(
                f"{self.label} {what}: {failed[0].message}", permanent=failed[0].permanent
            )
        if self.process is not None and self.process.poll() == NOT_INSTALLED_EXIT:
            return EngineFailed(self.log_tail().strip().splitlines()[-1], permanent=True)
        return EngineFailed(
            f"{self.label} {what}; last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    async def wait_ready(
        self,
        timeout: float,
        report: WorkerReport | None = None,
        relay: asyncio.Future[None] | None = None,
        poll: float = 0.2,
    ) -> list[EngineRankReport]:
        """Until vLLM's /health answers 200 and every rank has reported its load done;
        EngineFailed if vLLM exits, a rank reports a failure, or `timeout` passes. Meanwhile
        the ranks' steps so far go into `report` (the worker's status shows where vLLM is):
        phase Standby once every rank waits for the hand-off `relay` has not passed on yet,
        and, when the ranks compile first, vLLM has compiled and warmed up (answers /health):
        a spare shows as warm only once a hand-off would find nothing left but the weights."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        session = self.session()
        while True:
            reports = self.reports()
            if relay is not None and relay.done():
                relay.result()  # its failure is the bring-up's
            if report is not None:
                fold_steps(report, reports)
                waiting = [r for r in reports if r.stage == "standby"]
                tp = self.plan.tensor_parallel
                if (
                    relay is not None
                    and not relay.done()
                    and len(waiting) == tp
                    and (report.phase == WorkerPhase.STANDBY or await self._warm(session, waiting))
                ):
                    report.phase = WorkerPhase.STANDBY
                    # Each rank ran its init hooks before it stopped at its weight step: a
                    # spare or standby target says so while it waits, not only once Ready.
                    report.hooks = [
                        h for r in sorted(waiting, key=lambda r: r.rank) for h in r.hooks
                    ]
                    report.hooks_run = True
            code = self.process.poll()
            if code is not None:
                raise self._failure(f"exited with code {code} before it was ready")
            if any(not r.ok for r in reports):
                raise self._failure("failed to load")
            done = [r for r in reports if r.stage == "done" and not r.publishing]
            if len(done) == self.plan.tensor_parallel and await self._healthy(session):
                return reports
            if time.monotonic() > deadline:
                raise self._failure(f"not ready within {timeout:.0f}s")
            await asyncio.sleep(poll)

    async def _warm(self, session: aiohttp.ClientSession, waiting: list[EngineRankReport]) -> bool:
        """Ranks at their weight step: warm, unless they compile first and vLLM is not up yet
        (it compiles and warms up on placeholders after the ranks reported standby)."""
        return not all(r.compiles_first for r in waiting) or await self._healthy(session)

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        for path in self.health_paths:
            try:
                async with session.get(self.url + path) as resp:
                    if resp.status != 200:
                        return False
            except (TimeoutError, aiohttp.ClientError):
                return False
        return True

    async def wait_exit(self) -> int:
        assert self.process is not None
        while (code := self.process.poll()) is None:
            await asyncio.sleep(0.5)
        return code

    async def stop(self, grace: float = 15.0) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # vLLM shuts its engine core down on SIGTERM
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self._session

    # -------------------------------------------------------------------------- the worker
    @classmethod
    def for_worker(cls, plan: WorkerPlan) -> VllmEngine:
        base = os.environ.get(WORKDIR_ENV)
        if base:
            workdir = Path(base) / plan.pod_name
        else:
            workdir = Path(tempfile.mkdtemp(prefix=f"wl-vllm-{plan.pod_name}-"))
        return cls(plan, workdir)

    async def bring_up(self, ctx: BringUp) -> None:
        """Start vLLM, wait until it serves, fold the ranks' reports into the worker's report,
        install the P2P manifest proxy (when every rank published) and mark the worker Ready.
        The init hooks run inside vLLM, in each rank's process before its weights load (the
        load format does it): a hook's per-device state must live where the rank's device is
        driven, not in this front process."""
        state, app = ctx.state, ctx.app
        self.app = app
        if ctx.fetched is not None:
            self.plan = self.plan.model_copy(update={"model_dir": ctx.fetched.model_dir})
        rep = state.report
        rep.phase = WorkerPhase.LOADING
        # Fail fast and permanently on a wrong directory.
        check_model_dir(self.plan.model_dir, weights=ctx.has_weights and holds_weights(self.plan))
        timeout = float(self.plan.loading.load_timeout_seconds)
        if ctx.handoff_file is None:
            await self.compile_cache.before_start(self.session(), state.peer_token)
            self.start()
            reports = await self.wait_ready(timeout, rep)
        else:
            reports = await self.bring_up_standby(ctx, ctx.handoff_file, timeout)
        fold_steps(rep, reports)
        rep.hooks = [h for r in sorted(reports, key=lambda r: r.rank) for h in r.hooks]
        rep.hooks_run = True
        rep.load_phases = max((r.load_phases for r in reports), key=lambda p: sum(p.values()))
        rep.strategy = ",".join(sorted({r.strategy for r in reports}))
        rep.loaded_from = ",".join(sorted({r.loaded_from for r in reports}))
        rep.transports = [
            RankTransport(rank=r.rank, transport=r.transport, note=r.transport_note)
            for r in sorted(reports, key=lambda r: r.rank)
            if r.transport
        ]
        rep.bytes_loaded = sum(r.bytes_loaded for r in reports)
        rep.bytes_total = sum(r.bytes_total for r in reports)
        seconds = max(r.seconds for r in reports)
        rep.load_seconds = round(seconds, 4)
        rep.gbps = round(rep.bytes_loaded / seconds / 1e9, 4) if seconds > 0 else None
        failures = [f for r in reports for f in r.peer_failures]
        if failures:
            rep.message = "peer-to-peer failed, loaded from storage: " + "; ".join(failures)
        addresses = {r.rank: r.manifest_address for r in reports if r.manifest_address}
        proxy = None
        if len(addresses) == self.plan.tensor_parallel:  # a source only with every rank
            proxy = ManifestProxy(self, addresses)
        # Packed before Ready: whoever sees this replica Ready can fetch its compile cache.
        log_text = self.log_since_start()
        rep.compile_cache, routes = await self.compile_cache.after_ready(log_text, proxy)
        set_p2p_handler(app, routes)
        rep.phase = WorkerPhase.SERVING
        rep.timeline["serving"] = round(time.time(), 3)
        state.ready = True
        log.info(
            "vLLM serves %s on %s after %.1fs (weights: %s from %s in %.3fs)",
            self.plan.served_model_name,
            self.url,
            time.monotonic() - self.started_at,
            rep.strategy,
            rep.loaded_from,
            seconds,
        )

    async def bring_up_standby(
        self, ctx: BringUp, path: Path, timeout: float
    ) -> list[EngineRankReport]:
        """vLLM starts at once; meanwhile the worker waits for the pod's hand-off, installs the
        handed peer's compile cache (vLLM compiles after its weight step, so the program still
        arrives in time) and only then relays the hand-off to the ranks' weight step."""
        relay_file = self.workdir / "handoff.json"
        relay_file.unlink(missing_ok=True)
        if compiles_before_weights(os.environ, self.plan):
            # The ranks compile at once, before any peer is known: only a store can give the
            # program now (loader.py; a rank that cannot compile first gets the peer's later).
            await self.compile_cache.before_start(self.session(), ctx.state.peer_token)
        else:
            self.compile_cache.facts()  # the engine versions, read beside vLLM's start
        self.relay_file = relay_file
        self.start()
        relay = asyncio.ensure_future(self.relay_handoff(ctx, path, relay_file))
        try:
            limit = timeout + wait_limit(self.plan) + RELAY_MARGIN_SECONDS
            return await self.wait_ready(limit, ctx.state.report, relay)
        finally:
            relay.cancel()

    async def relay_handoff(self, ctx: BringUp, path: Path, relay_file: Path) -> None:
        """The pod's hand-off (peers or storage), bounded as worker/standby.py bounds it,
        passed on to vLLM's ranks once the peer's compile cache is installed; or, when the
        ranks compile first (loader.py), once vLLM has compiled, warmed up and answers
        /health: the weights then go in while it is idle."""
        rep = ctx.state.report
        handoff = await wait_for_handoff(path, wait_limit(self.plan))
        rep.timeline["peers"] = round(time.time(), 3)
        self.plan = apply_handoff(self.plan, handoff)
        self.compile_cache.plan = self.plan
        if not self.plan.peers:
            rep.role = str(Role.SOURCE)
        if await self._ranks_compile_first():
            while not await self._healthy(self.session()):
                await asyncio.sleep(0.1)
        else:
            await self.compile_cache.before_start(self.session(), ctx.state.peer_token)
        tmp = relay_file.with_suffix(".tmp")
        tmp.write_text(handoff.to_text())
        os.replace(tmp, relay_file)  # atomically: a rank never reads half of it
        rep.phase = WorkerPhase.LOADING
        log.info("standby over, relayed to vLLM: %s", handoff.to_text())

    async def _ranks_compile_first(self) -> bool:
        """Once every rank has reached standby: whether they all hold placeholders (a rank
        that cannot, a quantized model, waits at its weight step and needs the relay now)."""
        while True:
            reports = self.reports()
            if any(not r.ok for r in reports):
                return False  # wait_ready reports the failure
            waiting = [r for r in reports if r.stage == "standby"]
            if len(waiting) == self.plan.tensor_parallel:
                return all(r.compiles_first for r in waiting)
            await asyncio.sleep(0.1)

    async def serve_until(self, stop: asyncio.Future[Any]) -> None:
        """Until `stop` completes; EngineFailed when vLLM exits first."""
        exited = asyncio.ensure_future(self.wait_exit())
        try:
            await asyncio.wait({stop, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if not stop.done():
            raise self._failure(
                f"exited with code {self.process.poll() if self.process else '?'} while serving"
            )

    async def close(self) -> None:
        if self.app is not None:
            set_p2p_handler(self.app, None)
        await self.stop()

    # -------------------------------------------------------------------------- fronting
    def metadata(self) -> dict[str, Any] | None:
        return {"name": self.plan.served_model_name, "versions": ["1"], "platform": "vllm"}

    async def infer(self, request: web.Request) -> web.StreamResponse:
        m = self.plan.served_model_name
        return not_served(f"model {m!r} takes text: use /generate or the OpenAI API (/v1)")

    async def openai(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, self.url)

    async def metrics_text(self) -> str:
        """The engine's own Prometheus families (`metrics_prefixes`: vLLM's `vllm:*`, Triton's
        `nv_*`), each sample labelled with this replica's deployment and replica index, as
        Prometheus text; "" while the engine does not answer (exposition.relabel)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.metrics_with_key else {}
        try:
            async with self.session().get(
                self.metrics_url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status != 200:
                    return ""
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return ""
        labels = replica_labels(self.plan.deployment, self.plan.replica)
        return relabel(text, self.metrics_prefixes, labels)

    async def forward(self, request: web.Request, base: str) -> web.StreamResponse:
        """Pass `request` to `base` + its path and query; stream the answer back."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        if base == self.url:  # vLLM: the worker's key, never the caller's (a rank: its token)
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = await request.read()  # aiohttp keeps it: a handler that read it first is fine
        try:
            async with self.session().request(
                request.method, base + request.path_qs, data=body or None, headers=headers
            ) as upstream:
                resp = web.StreamResponse(status=upstream.status)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP_HEADERS:
                        resp.headers[k] = v
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"engine unreachable: {exc}"}, status=502)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Triton's generate extension (`text_input` -> `text_output`) over /v1/completions."""
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        if not isinstance(body, dict) or not isinstance(body.get("text_input"), str):
            return web.json_response({"error": "body needs a string 'text_input'"}, status=400)
        params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        completion: dict[str, Any] = {
            "model": self.plan.served_model_name,
            "prompt": body["text_input"],
            "max_tokens": int((params or {}).get("max_tokens", 16)),
            "temperature": float((params or {}).get("temperature", 0.0)),
        }
        try:
            async with self.session().post(
                self.url + "/v1/completions",
                json=completion,
                headers={"Authorization": f"Bearer {self.api_key}"},
            ) as up:
                doc = await up.json(content_type=None)
                if up.status != 200:
                    return web.json_response({"error": doc}, status=up.status)
        except (aiohttp.ClientError, ValueError) as exc:
            return web.json_response({"error": f"engine unreachable: {exc}"}, status=502)
        text = doc["choices"][0]["text"]
        return web.json_response(
            {"model_name": self.plan.served_model_name, "model_version": "1", "text_output": text}
        )


def fold_steps(report: WorkerReport, ranks: list[EngineRankReport]) -> None:
    """Each vLLM step's end (engine, hooks, load, processed) into the worker's timeline: the
    slowest rank's, so a step counts until every rank is past it."""
    for step in ("engine", "hooks", "standby", "load", "processed"):
        marks = [r.timeline[step] for r in ranks if step in r.timeline]
        if marks and len(marks) == len(ranks):
            report.timeline[step] = max(marks)


class ManifestProxy:
    """The P2P handler the worker installs: each vLLM rank serves its own manifest routes (its
    NIXL agent and memory live in its process). A request goes to the rank it names: `rank` in
    the query (manifest, health) or in the JSON body (sessions); health without one, rank 0."""

    def __init__(self, engine: VllmEngine, addresses: dict[int, str]) -> None:
        self.engine = engine
        self.bases = {rank: f"http://{address}" for rank, address in addresses.items()}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rank_text = request.query.get("rank")
        if rank_text is None and request.can_read_body:
            with contextlib.suppress(ValueError):
                body = json.loads(await request.read())
                rank_text = str(body.get("rank")) if isinstance(body, dict) else None
        try:
            base = self.bases[int(rank_text or 0)]
        except (KeyError, ValueError):
            return web.json_response(
                {
                    "error": "unknown_rank",
                    "message": f"this vLLM source holds ranks {sorted(self.bases)}, "
                    f"not {rank_text}",
                },
                status=404,
            )
        return await self.engine.forward(request, base)


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls it


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL vLLM when the worker goes away (PR_SET_PDEATHSIG)."""
    _LIBC.prctl(1, signal.SIGKILL)


# Where the worker reaches its engine (Triton's too): where `engine_host` binds it.
_connect_host = engine_host
