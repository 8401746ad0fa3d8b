"""The weightlift worker's side of a Triton replica: write the model repository, start the real
tritonserver, watch it, report, front it.

tritonserver serves HTTP on `runtime.enginePort`, gRPC on `runtime.engineGrpcPort` and metrics
on `runtime.engineMetricsPort`; its one model (the served model name) is a Python-backend model
that runs vLLM with `--load-format weightlift` in Triton's stub (see `backend`), so the weights,
init hooks, per-rank publishing and reports are exactly vLLM's (`engines.vllm`). The worker
stays the pod's front door on `runtime.port`: status and P2P as with vLLM (each rank's manifest
server), Ready once Triton's /v2/health/ready and /v2/models/{m}/ready answer and every rank
has reported, `/v2/models/{m}[/versions/v]/{infer,generate}` forwarded to Triton, Triton's `nv_*`
metrics re-exported on the worker's /metrics (labelled with the replica, as vLLM's).

tritonserver dies with the worker (PR_SET_PDEATHSIG); Triton's stub exits when tritonserver is
gone (it watches its parent).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from aiohttp import web

from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.base import BringUp, not_served
from weightlift.worker.engines.triton.install import (
    PythonInfo,
    backend_dir,
    engine_python_info,
    server_root,
    stub_site,
)
from weightlift.worker.engines.triton.repository import write_repository
from weightlift.worker.engines.vllm.engine import (
    EngineFailed,
    VllmEngine,
    _connect_host,
    engine_args,
    engine_python,
    vllm_environment,
)
from weightlift.worker.engines.vllm.plugin import DIE_WITH_PARENT_ENV

# Seconds tritonserver waits for in-flight requests at SIGTERM (the worker's grace is 15 s).
EXIT_TIMEOUT_SECONDS = 10
# Triton's model load failures, as its log words them.
_REFUSED = re.compile(r"(failed to load '[^']*'.*|Failed to create instance: .*|error: .*)")


def triton_command(plan: WorkerPlan, server: Path, backends: Path, repository: Path) -> list[str]:
    rt = plan.runtime
    host = plan.host
    return [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        f"--http-address={host}",
        f"--http-port={rt.engine_port}",
        f"--grpc-address={host}",
        f"--grpc-port={rt.engine_grpc_port}",
        f"--metrics-address={host}",
        f"--metrics-port={rt.engine_metrics_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--pinned-memory-pool-byte-size=0",
        f"--exit-timeout-secs={EXIT_TIMEOUT_SECONDS}",
        "--strict-readiness=true",
        "--log-info=true",
    ]


def triton_environment(python: PythonInfo) -> dict[str, str]:
    env = vllm_environment()
    # Not in the stub: Triton starts it from a model-load thread that ends after the load, and
    # PR_SET_PDEATHSIG fires when the forking *thread* exits. The stub watches tritonserver
    # itself and exits when it is gone.
    env.pop(DIE_WITH_PARENT_ENV, None)
    # The stub links libpython<X.Y>.so: the engine's own, not another install's.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (python.libdir, env.get("LD_LIBRARY_PATH", "")) if p
    )
    # vLLM's engine core in the stub's process: no child interpreters to start from a stub.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def refusal(log_text: str) -> str | None:
    """Triton's first model-load error in its log, if any (quotes unescaped, one line)."""
    for line in log_text.splitlines():
        found = _REFUSED.search(line)
        if found:
            text = found.group(1).replace("\\n", " ").replace('\\"', '"').rstrip('"')
            return re.sub(r"\s+", " ", text)[:800]
    return None


class TritonEngine(VllmEngine):
    """One tritonserver for one replica; its model runs all the replica's ranks."""

    label = "tritonserver"
    serves_v2 = True  # the worker forwards /v2/models/{m}/... to it
    # A standby Target starts tritonserver at once, as vLLM's: the model's vLLM builds, runs the
    # hooks and its weight step waits for the relayed hand-off (inside Triton's model load).
    prepares_standby = True
    # Triton's own families, from its metrics port (VllmEngine.metrics_text).
    metrics_prefixes = ("nv_",)
    metrics_with_key = False  # vLLM's key is not Triton's business

    def __init__(self, plan: WorkerPlan, workdir: Path) -> None:
        super().__init__(plan, workdir)
        self.log_path = workdir / "tritonserver.log"
        self.repository = workdir / "repository"
        name = plan.served_model_name
        self.health_paths = ("/v2/health/ready", f"/v2/models/{name}/ready")
        host = _connect_host(plan.host)
        self.metrics_url = f"http://{host}:{plan.runtime.engine_metrics_port}/metrics"

    def start(self) -> None:
        root = server_root()
        python = engine_python_info(engine_python())
        backends = backend_dir(root, python.version)
        argv = engine_args(self.plan, self._write_plan(), self.report_dir, self.relay_file)
        site = stub_site(python.version, backends=backends)
        write_repository(self.repository, self.plan.served_model_name, python, argv, site)
        cmd = triton_command(self.plan, root, backends, self.repository)
        self._spawn(cmd, triton_environment(python), cwd=self.workdir)

    def _failure(self, what: str) -> EngineFailed:
        failed = [r for r in self.reports() if not r.ok]
        if not failed:
            try:
                refused = refusal(self.log_path.read_text(errors="replace"))
            except OSError:
                refused = None
            if refused:
                return EngineFailed(
                    f"tritonserver {what}: it refused model {self.plan.served_model_name!r} of "
                    f"repository {self.repository}: {refused} (log: {self.log_path})"
                )
        return super()._failure(what)

    def ports(self) -> dict[str, int]:
        rt = self.plan.runtime
        return {
            "http": rt.engine_port,
            "grpc": rt.engine_grpc_port,
            "metrics": rt.engine_metrics_port,
        }

    async def bring_up(self, ctx: BringUp) -> None:
        ctx.state.report.engine_ports = self.ports()
        await super().bring_up(ctx)

    # -------------------------------------------------------------------------- fronting
    def metadata(self) -> dict[str, Any] | None:
        """Triton's own answer for this model (repository.CONFIG_PBTXT)."""
        return {
            "name": self.plan.served_model_name,
            "versions": ["1"],
            "platform": "python",
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}],
        }

    async def infer(self, request: web.Request) -> web.StreamResponse:
        """Triton's own infer (tritonclient's BYTES tensors, request parameters)."""
        return await self.forward(request, self.url)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Triton's own generate extension."""
        return await self.forward(request, self.url)

    async def openai(self, request: web.Request) -> web.StreamResponse:
        return not_served(
            "tritonserver serves KServe v2 and generate, not the OpenAI API: use "
            f"/v2/models/{self.plan.served_model_name}/generate"
        )

    @classmethod
    def for_worker(cls, plan: WorkerPlan) -> TritonEngine:
        engine = super().for_worker(plan)
        assert isinstance(engine, TritonEngine)
        return engine
