"""`weightlift bench vllm`: vLLM start-to-ready with its own loader vs weightlift preload vs P2P.

One run, one host, one model (a random-weight Llama in HF layout, made locally; `--hidden` and
`--layers` set its size), page cache warm for all three (the files are read once first):

  auto     vLLM's OpenAI server with `--load-format auto` (its default safetensors loader)
  preload  a `weightlift worker` with runtime.engine vLLM, role Source: weightlift's preload
           inside vLLM (`--load-format weightlift`), then it publishes its rank's parameters
  p2p      a second worker, role Target, pulling its rank's parameters from the preload one
           over NIXL (checksums verified) while that one keeps serving

Seconds to ready: process start until vLLM's /health answers (for the workers: until their
status says Serving, which waits for /health). Load seconds and GB/s: vLLM's "Loading weights
took" line for auto; the load format's own report for preload and P2P. Ratios are against auto.
Imports dominate start-to-ready on CPU (tens of seconds), so expect ratios near 1 there and the
difference in the load columns.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.api.model import Engine, ModelFormat, ModelSource, Role, RuntimeSpec
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.local.llm import ensure_vllm_env, make_in_engine_env, vllm_python
from weightlift.local.net import free_port
from weightlift.local.observe import complete
from weightlift.local.stack import VLLM_ENGINE_ARGS, VLLM_ENV

JSON = dict[str, Any]
_LOAD_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise click.ClickException(f"not ready in {timeout}s; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _env(python: Path, workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        **VLLM_ENV,
        "WEIGHTLIFT_VLLM_PYTHON": str(python),
        "WEIGHTLIFT_ENGINE_DIR": str(workdir),
    }


def run_auto(python: Path, model: Path, workdir: Path, timeout: float) -> tuple[JSON, Any]:
    port = free_port()
    log = workdir / "auto.log"
    argv = [str(python), "-m", "weightlift.worker.engines.vllm.serve", "--model", str(model)]
    argv += ["--served-model-name", "llm", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--load-format", "auto", *VLLM_ENGINE_ARGS]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=_env(python, workdir), stdout=out, stderr=out)
    _wait(f"http://127.0.0.1:{port}/health", proc, log, timeout)
    ready = time.monotonic() - started
    m = _LOAD_LINE.search(log.read_text(errors="replace"))
    row = {"ready_s": ready, "load_s": float(m.group(1)) if m else None, "from": "storage"}
    return row, (proc, f"http://127.0.0.1:{port}/v1")


def run_worker(
    python: Path,
    model: Path,
    workdir: Path,
    role: Role,
    peers: list[PeerCandidate],
    timeout: float,
) -> tuple[JSON, Any]:
    plan = WorkerPlan(
        deployment="bench",
        pod_name=f"bench-{role.value.lower()}",
        role=role,
        peers=peers,
        model_identity="bench-llm",
        model=ModelSource(uri=f"file://{model}", format=ModelFormat.SAFETENSORS),
        model_dir=str(model),
        served_model_name="llm",
        device="cpu",
        host="127.0.0.1",
        runtime=RuntimeSpec(
            engine=Engine.VLLM,
            port=free_port(),
            engine_port=free_port(),
            engine_args=VLLM_ENGINE_ARGS,
        ),
    )
    plan_file = workdir / f"{plan.pod_name}.json"
    plan_file.write_text(plan.model_dump_json(by_alias=True))
    log = workdir / f"{plan.pod_name}.log"
    exe = str(Path(sys.executable).parent / "weightlift")
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [exe, "worker", "--plan", str(plan_file)],
            env=_env(python, workdir),
            stdout=out,
            stderr=out,
        )
    address = f"127.0.0.1:{plan.runtime.port}"
    _wait(f"http://{address}/v2/health/ready", proc, log, timeout)
    ready = time.monotonic() - started
    st = httpx.get(f"http://{address}/weightlift/v1/status", timeout=5).json()
    row = {
        "ready_s": ready,
        "load_s": st.get("loadSeconds"),
        "gbps": st.get("gbps"),
        "from": st.get("loadedFrom"),
        "bytes": st.get("bytesTotal"),
        "phases": st.get("loadPhases") or {},
    }
    return row, (proc, f"http://127.0.0.1:{plan.runtime.engine_port}/v1", address, plan.pod_name)


@click.command("vllm")
@click.option("--hidden", type=int, default=1024, show_default=True, help="Model width.")
@click.option("--layers", type=int, default=4, show_default=True, help="Decoder layers.")
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
def vllm_command(
    hidden: int, layers: int, timeout: float, json_out: Path | None, workdir: Path | None
) -> None:
    """vLLM seconds-to-ready and load GB/s: --load-format auto vs weightlift preload vs P2P."""
    python = vllm_python() or ensure_vllm_env()
    work = workdir or Path(tempfile.mkdtemp(prefix="wl-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"llama-h{hidden}-l{layers}"
    probe = make_in_engine_env(python, model, layers=layers, hidden=hidden)["completion"]
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for f in model.glob("*.safetensors"):  # warm page cache for every contender
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    rows: dict[str, JSON] = {}
    texts: dict[str, str] = {}
    auto, (proc, url) = run_auto(python, model, work, timeout)
    try:
        texts["auto"] = complete(url, "llm", probe)
    finally:
        _stop(proc)
    rows["auto"] = {**auto, "gbps": size / auto["load_s"] / 1e9 if auto["load_s"] else None}
    src, (sproc, surl, saddr, spod) = run_worker(python, model, work, Role.SOURCE, [], timeout)
    try:
        rows["preload"] = src
        texts["preload"] = complete(surl, "llm", probe)
        peer = [PeerCandidate(pod=spod, address=saddr)]
        tgt, (tproc, turl, _, _) = run_worker(python, model, work, Role.TARGET, peer, timeout)
        try:
            rows["p2p"] = tgt
            texts["p2p"] = complete(turl, "llm", probe)
        finally:
            _stop(tproc)
    finally:
        _stop(sproc)
    _print(rows, size, hidden, layers)
    same = len(set(texts.values())) == 1 and probe["expectedText"] in texts.values()
    click.echo(f"greedy completions: {'identical, as transformers' if same else texts}")
    if json_out:
        json_out.write_text(json.dumps({"bytes": size, "rows": rows, "texts": texts}, indent=1))


def _print(rows: dict[str, JSON], size: int, hidden: int, layers: int) -> None:
    base = rows["auto"]
    click.echo(f"model: Llama hidden {hidden}, {layers} layers, {size / 1e6:.1f} MB fp32")
    click.echo(f"{'loader':<9}{'from':<22}{'ready s':>9}{'x auto':>8}{'load s':>9}{'GB/s':>8}")
    for name, r in rows.items():
        ratio = base["ready_s"] / r["ready_s"] if r["ready_s"] else 0.0
        load = f"{r['load_s']:.3f}" if r.get("load_s") is not None else "-"
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
        click.echo(
            f"{name:<9}{r.get('from')!s:<22}{r['ready_s']:>9.1f}{ratio:>8.2f}{load:>9}{gbps:>8}"
        )
    for name, r in rows.items():
        if r.get("phases"):
            steps = ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
            click.echo(f"{name} load steps (s): {steps}")
