"""`weightlift bench triton`: Triton start-to-ready with vLLM's own loader inside tritonserver vs
weightlift preload vs P2P, same model, same run.

One host, one model (the random-weight Llama of `bench vllm`, `--hidden`/`--layers`), page cache
warm for all three, vLLM eager (`--enforce-eager`) inside Triton's Python backend:

  triton-auto     tritonserver whose model runs vLLM with `--load-format auto`
  triton-preload  a `weightlift worker` with runtime.engine Triton, role Source: weightlift's
                  preload inside the stub's vLLM, then it publishes its rank's parameters
  triton-p2p      a second one, role Target, pulling its rank's parameters from triton-preload
                  over NIXL (checksums verified) while that one keeps serving

Seconds to ready: process start until the model's ready endpoint answers (the workers: until
their /v2/health/ready, which waits for Triton's). Load seconds: vLLM's "Loading weights took"
line for auto; the load format's own report for preload and P2P. Every row's greedy text comes
from Triton's generate extension. Needs hack/install-triton.sh's install.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.api.model import Role
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.bench.vllm import _LOAD_LINE, _env, _stop, _wait, spawn_worker
from weightlift.local.llm import (
    ensure_triton_env,
    ensure_vllm_env,
    make_in_engine_env,
    vllm_worker_plan,
)
from weightlift.local.llm import vllm_python as find_vllm_python
from weightlift.local.observe import generate
from weightlift.local.stack import VLLM_ENV, vllm_engine_args
from weightlift.worker.engines.triton.engine import triton_command, triton_environment
from weightlift.worker.engines.triton.install import (
    backend_dir,
    engine_python_info,
    server_root,
    stub_site,
)
from weightlift.worker.engines.triton.repository import write_repository

JSON = dict[str, Any]
ARGS = vllm_engine_args(eager=True)


def _plan(model: Path, role: Role, peers: list[PeerCandidate]) -> WorkerPlan:
    pod = f"bench-triton-{role.value.lower()}"
    return vllm_worker_plan(
        model, pod, role, peers, ARGS, deployment="bench", identity="bench-llm-triton", triton=True
    )


def run_triton_auto(python: Path, model: Path, work: Path, timeout: float) -> tuple[JSON, Any]:
    """tritonserver whose Python-backend model runs vLLM with its own loader."""
    info = engine_python_info(str(python))
    root = server_root()
    plan = _plan(model, Role.SOURCE, [])
    argv = ["--model", str(model), "--served-model-name", "llm", "--load-format", "auto", *ARGS]
    repo = work / "triton-auto-repository"
    write_repository(repo, "llm", info, argv, stub_site(info.version))
    cmd = triton_command(plan, root, backend_dir(root, info.version), repo)
    log = work / "triton-auto.log"
    started = time.monotonic()
    with log.open("wb") as out:
        env = {**triton_environment(info), **VLLM_ENV}
        env["VLLM_CACHE_ROOT"] = str(work / "vllm-cache-triton-auto")
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{plan.runtime.engine_port}"
    _wait(f"{base}/v2/models/llm/ready", proc, log, timeout)
    ready = time.monotonic() - started
    m = _LOAD_LINE.search(log.read_text(errors="replace"))
    row = {"ready_s": ready, "load_s": float(m.group(1)) if m else None, "from": "storage"}
    return row, (proc, base)


def run_triton_worker(
    python: Path, model: Path, work: Path, role: Role, peers: list[PeerCandidate], timeout: float
) -> tuple[JSON, Any]:
    plan = _plan(model, role, peers)
    w = spawn_worker(plan, _env(python, work, plan.pod_name), work)
    address = w.address
    _wait(f"http://{address}/v2/health/ready", w.proc, w.log, timeout)
    ready = time.monotonic() - w.started
    st = httpx.get(f"http://{address}/weightlift/v1/status", timeout=5).json()
    row = {
        "ready_s": ready,
        "load_s": st.get("loadSeconds"),
        "gbps": st.get("gbps"),
        "from": st.get("loadedFrom"),
        "phases": st.get("loadPhases") or {},
    }
    base = f"http://127.0.0.1:{plan.runtime.engine_port}"
    return row, (w.proc, base, address, plan.pod_name)


@click.command("triton")
@click.option("--hidden", type=int, default=1024, show_default=True, help="Model width.")
@click.option("--layers", type=int, default=4, show_default=True, help="Decoder layers.")
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--plot",
    "png",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the contenders' seconds to ready and load GB/s here (PNG).",
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
def triton_command_line(
    hidden: int,
    layers: int,
    timeout: float,
    json_out: Path | None,
    png: Path | None,
    workdir: Path | None,
) -> None:
    """Triton seconds to ready: vLLM's own loader inside Triton vs weightlift preload vs P2P."""
    python = find_vllm_python() or ensure_vllm_env()
    ensure_triton_env()
    work = workdir or Path(tempfile.mkdtemp(prefix="wl-bench-triton-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"llama-h{hidden}-l{layers}"
    probe = make_in_engine_env(python, model, layers=layers, hidden=hidden)["completion"]
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for f in model.glob("*.safetensors"):  # warm page cache for every contender
        f.read_bytes()
    rows: dict[str, JSON] = {}
    texts: dict[str, str] = {}
    auto, (proc, url) = run_triton_auto(python, model, work, timeout)
    try:
        texts["triton-auto"] = generate(url, "llm", probe)
    finally:
        _stop(proc)
    rows["triton-auto"] = {**auto, "gbps": size / auto["load_s"] / 1e9 if auto["load_s"] else None}
    src, (sproc, surl, saddr, spod) = run_triton_worker(
        python, model, work, Role.SOURCE, [], timeout
    )
    try:
        rows["triton-preload"] = src
        texts["triton-preload"] = generate(surl, "llm", probe)
        peers = [PeerCandidate(pod=spod, address=saddr)]
        tgt, (tproc, turl, _, _) = run_triton_worker(
            python, model, work, Role.TARGET, peers, timeout
        )
        try:
            rows["triton-p2p"] = tgt
            texts["triton-p2p"] = generate(turl, "llm", probe)
        finally:
            _stop(tproc)
    finally:
        _stop(sproc)
    _print(rows, size, hidden, layers)
    same = len(set(texts.values())) == 1 and probe["expectedText"] in texts.values()
    click.echo(
        f"greedy text through Triton's generate: {'identical, as transformers' if same else texts}"
    )
    if json_out:
        json_out.write_text(json.dumps({"bytes": size, "rows": rows, "texts": texts}, indent=1))
    if png:
        from weightlift.bench.charts import plot, vllm_panels

        title = f"weightlift bench triton: {size / 1e6:.0f} MB Llama, vLLM eager inside Triton"
        click.echo(f"wrote {plot(vllm_panels({'rows': rows}, 'triton-auto'), title, png)}")


def _print(rows: dict[str, JSON], size: int, hidden: int, layers: int) -> None:
    base = rows["triton-auto"]
    click.echo(f"model: Llama hidden {hidden}, {layers} layers, {size / 1e6:.1f} MB fp32, eager")
    click.echo(f"{'loader':<16}{'from':<26}{'ready s':>9}{'x auto':>8}{'load s':>9}{'GB/s':>8}")
    for name, r in rows.items():
        ratio = base["ready_s"] / r["ready_s"] if r["ready_s"] else 0.0
        load = f"{r['load_s']:.3f}" if r.get("load_s") is not None else "-"
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
        click.echo(
            f"{name:<16}{r.get('from')!s:<26}{r['ready_s']:>9.1f}{ratio:>8.2f}{load:>9}{gbps:>8}"
        )
