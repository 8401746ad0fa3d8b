"""`weightlift bench vllm`: vLLM start-to-ready with its own loader vs weightlift preload vs P2P,
with and without the source's compile cache.

One run, one host, one model (a random-weight Llama in HF layout, made locally; `--hidden` and
`--layers` set its size), page cache warm for all (the files are read once first). vLLM runs in
its default compiled mode (torch.compile with Inductor; `--enforce-eager` skips compilation), each
contender with its own empty vLLM cache root, so every compile is cold unless a cache travelled:

  auto       vLLM's OpenAI server with `--load-format auto` (its default safetensors loader)
  preload    a `weightlift worker` with runtime.engine vLLM, role Source: weightlift's preload
             inside vLLM (`--load-format weightlift`), then it publishes its rank's parameters
             and (compiled mode) its compile cache
  p2p        a worker, role Target, pulling its rank's parameters from the preload one over NIXL
             (checksums verified) while that one keeps serving; compile cache not fetched
  p2p+cache  the same, and it installs the source's verified compile cache before vLLM starts
  source, store hit
             compiled mode: a fresh source (no Ready peer, its own empty vLLM cache root) that
             installs the compile cache the preload source wrote to a node store
             (WEIGHTLIFT_COMPILE_STORE) before vLLM starts, so it does not compile
  own image  a source whose vLLM environment holds no weightlift (bench/own_image.py): the
             init container's copy of the worker bundle, then its launcher, as a pod with
             spec.template.worker Injected; compared with preload (goal: at most 1.05x)
  p2p+cache+standby
             a fresh source and a target started together: the target's vLLM starts at once and
             waits in Standby; the hand-off (the operator's annotation, here written to its file
             the moment the source is Ready) brings the peer and its compile cache

Seconds to ready: process start until vLLM's /health answers (for the workers: until their
status says Serving, which waits for /health). Load seconds and GB/s: vLLM's "Loading weights
took" line for auto; the load format's own report for preload and P2P. Ratios are against auto.
Init seconds: vLLM's "init engine (profile, create kv cache, warmup model) took" line, where the
compile goes; compile cache: the worker's compileCache. Tokens/s: one greedy completion of
`--gen-tokens` tokens (EOS ignored) after ready, on the same prompt for every contender.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.api.model import Role
from weightlift.api.worker import (
    COMPILE_STORE_ENV,
    PEERS_FILE_ENV,
    PeerCandidate,
    PeerHandoff,
    WorkerPlan,
)
from weightlift.local.llm import (
    ensure_vllm_env,
    make_in_engine_env,
    vllm_python,
    vllm_worker_plan,
)
from weightlift.local.net import free_port
from weightlift.local.observe import complete
from weightlift.local.stack import VLLM_ENV, vllm_engine_args
from weightlift.worker.engines.vllm.compile_cache import MAX_BYTES_ENV, engine_init_seconds

JSON = dict[str, Any]
_LOAD_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")


def tokens_per_second(openai_base: str, prompt: str, tokens: int) -> float | None:
    """Greedy decode speed: `tokens` new tokens (EOS ignored) over the request's wall time."""
    body = {
        "model": "llm",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    resp = httpx.post(f"{openai_base}/completions", json=body, timeout=600)
    elapsed = time.monotonic() - started
    if resp.status_code != 200:
        return None
    done = int((resp.json().get("usage") or {}).get("completion_tokens") or 0)
    return done / elapsed if elapsed > 0 else None


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


def _env(python: Path, workdir: Path, name: str, **extra: str) -> dict[str, str]:
    """Each contender its own empty vLLM cache root: a compile is cold unless a cache travels."""
    return {
        **os.environ,
        **VLLM_ENV,
        "WEIGHTLIFT_VLLM_PYTHON": str(python),
        "WEIGHTLIFT_ENGINE_DIR": str(workdir),
        "VLLM_CACHE_ROOT": str(workdir / f"vllm-cache-{name}"),
        **extra,
    }


def run_auto(
    python: Path, model: Path, workdir: Path, timeout: float, args: list[str]
) -> tuple[JSON, Any]:
    port = free_port()
    log = workdir / "auto.log"
    argv = [str(python), "-m", "weightlift.worker.engines.vllm.serve", "--model", str(model)]
    argv += ["--served-model-name", "llm", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--load-format", "auto", *args]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=_env(python, workdir, "auto"), stdout=out, stderr=out)
    _wait(f"http://127.0.0.1:{port}/health", proc, log, timeout)
    ready = time.monotonic() - started
    text = log.read_text(errors="replace")
    m = _LOAD_LINE.search(text)
    row = {
        "ready_s": ready,
        "load_s": float(m.group(1)) if m else None,
        "from": "storage",
        "init_s": engine_init_seconds(text),
        "compile_cache": "-",
    }
    return row, (proc, f"http://127.0.0.1:{port}/v1")


@dataclass
class Started:
    """A worker process on its way up."""

    proc: subprocess.Popen[bytes]
    address: str
    pod: str
    log: Path
    workdir: Path
    started: float


def start_worker(
    python: Path,
    model: Path,
    workdir: Path,
    role: Role,
    peers: list[PeerCandidate],
    args: list[str],
    name: str,
    **extra_env: str,
) -> Started:
    plan = vllm_worker_plan(
        model, f"bench-{name}", role, peers, args, deployment="bench", identity="bench-llm"
    )
    return spawn_worker(plan, _env(python, workdir, name, **extra_env), workdir)


def spawn_worker(plan: WorkerPlan, env: dict[str, str], workdir: Path) -> Started:
    """`weightlift worker --plan` as a pod would run it, its output in `<pod>.log`."""
    plan_file = workdir / f"{plan.pod_name}.json"
    plan_file.write_text(plan.model_dump_json(by_alias=True))
    log = workdir / f"{plan.pod_name}.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightlift", "worker", "--plan", str(plan_file)],
            env=env,
            stdout=out,
            stderr=out,
        )
    address = f"127.0.0.1:{plan.runtime.port}"
    return Started(proc, address, plan.pod_name, log, workdir, started)


def finish_worker(w: Started, timeout: float) -> tuple[JSON, Any]:
    """Until the worker is Ready; its row (seconds from its own start) and its handles."""
    _wait(f"http://{w.address}/v2/health/ready", w.proc, w.log, timeout)
    ready_at = time.monotonic()
    launched_wall = time.time() - (ready_at - w.started)
    st = httpx.get(f"http://{w.address}/weightlift/v1/status", timeout=5).json()
    row = {
        "ready_s": ready_at - w.started,
        "ready_at": ready_at,
        "load_s": st.get("loadSeconds"),
        "gbps": st.get("gbps"),
        "from": st.get("loadedFrom"),
        "bytes": st.get("bytesTotal"),
        "phases": st.get("loadPhases") or {},
        "init_s": engine_init_seconds((w.workdir / w.pod / "vllm.log").read_text(errors="replace")),
        "compile_cache": st.get("compileCache") or "-",
        # The worker's own marks (process start, server, load, serving), from its launch.
        "steps": {k: round(v - launched_wall, 2) for k, v in (st.get("timeline") or {}).items()},
    }
    return row, (w.proc, f"http://{w.address}/v1", w.address, w.pod)


def run_worker(
    python: Path,
    model: Path,
    workdir: Path,
    role: Role,
    peers: list[PeerCandidate],
    timeout: float,
    args: list[str],
    name: str,
    **extra_env: str,
) -> tuple[JSON, Any]:
    w = start_worker(python, model, workdir, role, peers, args, name, **extra_env)
    return finish_worker(w, timeout)


def run_standby(
    python: Path, model: Path, workdir: Path, timeout: float, args: list[str]
) -> tuple[JSON, JSON, Any]:
    """A source and a target started together: the target starts vLLM at once and waits in
    Standby for its hand-off (written here, as the operator's annotation would be, the moment
    the source is Ready), then pulls and installs the source's compile cache."""
    handoff = workdir / "standby-handoff.json"
    handoff.write_text("")
    src = start_worker(python, model, workdir, Role.SOURCE, [], args, "standby-source")
    tgt = start_worker(
        python,
        model,
        workdir,
        Role.TARGET,
        [],
        args,
        "standby-target",
        **{PEERS_FILE_ENV: str(handoff)},
    )
    try:
        srow, shandle = finish_worker(src, timeout)
    except BaseException:
        _stop(tgt.proc)
        raise
    given = PeerHandoff(peers=[PeerCandidate(pod=src.pod, address=src.address)])
    staged = handoff.with_suffix(".tmp")
    staged.write_text(given.to_text())
    staged.replace(handoff)  # atomic, as the kubelet swaps a downwardAPI file
    try:
        trow, thandle = finish_worker(tgt, timeout)
    except BaseException:
        _stop(src.proc)
        raise
    trow["after_source_s"] = trow["ready_at"] - srow["ready_at"]
    return srow, trow, (shandle, thandle)


@click.command("vllm")
@click.option("--hidden", type=int, default=1024, show_default=True, help="Model width.")
@click.option("--layers", type=int, default=4, show_default=True, help="Decoder layers.")
@click.option(
    "--enforce-eager",
    is_flag=True,
    help="vLLM without torch.compile (no compile, no compile cache); default: compiled.",
)
@click.option(
    "--gen-tokens", type=int, default=64, show_default=True, help="Tokens per speed request."
)
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--plot",
    "png",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the contenders' seconds to ready and load GB/s here (PNG).",
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--own-image/--no-own-image",
    default=True,
    show_default=True,
    help="The `own image` row: vLLM without weightlift, joined as an Injected pod is.",
)
@click.option(
    "--pairs",
    type=int,
    default=0,
    show_default=True,
    help="Then this many more (preload, own image) starts back to back, alternating order: "
    "the median of their ratios.",
)
@click.option(
    "--scale-up",
    is_flag=True,
    help="Also time scale-ups on the local stack with the operator: 1→2 served by a warm "
    "spare, 1→2 cold, 0→1 served by a spare (bench/vllm_scaleup.py).",
)
def vllm_command(
    hidden: int,
    layers: int,
    enforce_eager: bool,
    gen_tokens: int,
    timeout: float,
    json_out: Path | None,
    png: Path | None,
    workdir: Path | None,
    own_image: bool,
    pairs: int,
    scale_up: bool,
) -> None:
    """vLLM seconds-to-ready, compile and tokens/s: --load-format auto vs weightlift preload vs
    P2P, and P2P with the source's compile cache."""
    python = vllm_python() or ensure_vllm_env()
    work = workdir or Path(tempfile.mkdtemp(prefix="wl-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"llama-h{hidden}-l{layers}"
    probe_doc = make_in_engine_env(python, model, layers=layers, hidden=hidden)
    probe = probe_doc["completion"]
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for f in model.glob("*.safetensors"):  # warm page cache for every contender
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    args = vllm_engine_args(enforce_eager)
    rows: dict[str, JSON] = {}
    texts: dict[str, str] = {}

    def measure(name: str, row: JSON, url: str) -> None:
        texts[name] = complete(url, "llm", probe)
        rows[name] = {**row, "tok_s": tokens_per_second(url, probe["prompt"], gen_tokens)}

    auto, (proc, url) = run_auto(python, model, work, timeout, args)
    try:
        measure(
            "auto", {**auto, "gbps": size / auto["load_s"] / 1e9 if auto["load_s"] else None}, url
        )
    finally:
        _stop(proc)
    # Compiled mode: the source also writes its compile cache to a node store that outlives it,
    # which the `source, store hit` row (a fresh source, no Ready peer) installs before compiling.
    store = {} if enforce_eager else {COMPILE_STORE_ENV: str(work / "compile-store")}
    src, (sproc, surl, saddr, spod) = run_worker(
        python, model, work, Role.SOURCE, [], timeout, args, "source", **store
    )
    try:
        measure("preload", src, surl)
        peer = [PeerCandidate(pod=spod, address=saddr)]
        targets = {"p2p": {MAX_BYTES_ENV: "0"}, "p2p+cache": {}}
        for name, env in targets.items():
            if enforce_eager and name == "p2p+cache":
                continue  # nothing compiled, nothing to ship
            tgt, (tproc, turl, _, _) = run_worker(
                python, model, work, Role.TARGET, peer, timeout, args, name.replace("+", "-"), **env
            )
            try:
                measure(name, {**tgt, "after_source_s": tgt["ready_s"]}, turl)
            finally:
                _stop(tproc)
    finally:
        _stop(sproc)
    if own_image:
        own_image_row(measure, model, work, timeout, args)
    if not enforce_eager:
        hit, (hproc, hurl, _, _) = run_worker(
            python, model, work, Role.SOURCE, [], timeout, args, "store-hit", **store
        )
        try:
            measure("source, store hit", hit, hurl)
        finally:
            _stop(hproc)
        _, stby, ((s2, _, _, _), (t2, t2url, _, _)) = run_standby(
            python, model, work, timeout, args
        )
        try:
            measure("p2p+cache+standby", stby, t2url)
        finally:
            _stop(t2)
            _stop(s2)
    _print(rows, size, hidden, layers, "eager" if enforce_eager else "compiled")
    same = len(set(texts.values())) == 1 and probe["expectedText"] in texts.values()
    click.echo(f"greedy completions: {'identical, as transformers' if same else texts}")
    doc: JSON = {"bytes": size, "mode": "eager" if enforce_eager else "compiled", "rows": rows}
    if pairs:
        doc["ownImagePairs"] = _print_pairs(python, model, work, timeout, args, pairs)
    if scale_up:
        from weightlift.bench.vllm_scaleup import scale_up_rows

        ups = scale_up_rows(python, model, probe_doc, work, timeout, enforce_eager)
        doc["scaleUps"] = _print_scale_ups(ups, rows["auto"]["ready_s"])
    if json_out:
        json_out.write_text(json.dumps({**doc, "texts": texts}, indent=1))
    if png:
        from weightlift.bench.charts import plot, vllm_panels

        title = f"weightlift bench vllm: {size / 1e6:.0f} MB Llama, {doc['mode']}"
        click.echo(f"wrote {plot(vllm_panels(doc), title, png)}")


def own_image_row(
    measure: Callable[[str, JSON, str], None],
    model: Path,
    workdir: Path,
    timeout: float,
    args: list[str],
) -> None:
    """Measure the `own image` row, then stop it and remove its bundle copy."""
    from weightlift.bench.own_image import release_copies

    row, (proc, url, _, _) = run_own_image(model, workdir, timeout, args)
    try:
        measure("own image", row, url)
    finally:
        _stop(proc)
        release_copies()


def run_own_image(
    model: Path, workdir: Path, timeout: float, args: list[str], name: str = "own-image"
) -> tuple[JSON, Any]:
    """The `own image` row (bench/own_image.py), the same plan as preload's; `name` its own
    vLLM cache root (a start that reused an earlier one's would load its compiled program)."""
    from weightlift.bench.own_image import (
        build_bundle,
        ensure_plain_env,
        release_copies,
        start_own_image,
    )

    plain = ensure_plain_env()
    bundle = build_bundle(plain, workdir / "worker-bundle")
    env = _env(plain, workdir, name)
    proc, address, pod, log, started, copied = start_own_image(
        plain, bundle, model, workdir, args, env
    )
    try:
        row, handle = finish_worker(Started(proc, address, pod, log, workdir, started), timeout)
    except BaseException:
        _stop(proc)
        release_copies()
        raise
    return {**row, "copy_s": copied}, handle


def _print(rows: dict[str, JSON], size: int, hidden: int, layers: int, mode: str) -> None:
    base = rows["auto"]
    click.echo(
        f"model: Llama hidden {hidden}, {layers} layers, {size / 1e6:.1f} MB fp32; vLLM {mode}"
    )
    click.echo(
        f"{'loader':<18}{'from':<28}{'ready s':>8}{'x auto':>7}{'load s':>8}{'GB/s':>7}"
        f"{'init s':>8}{'tok/s':>8}  compile cache"
    )
    for name, r in rows.items():
        ratio = base["ready_s"] / r["ready_s"] if r["ready_s"] else 0.0
        load = f"{r['load_s']:.3f}" if r.get("load_s") is not None else "-"
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
        init = f"{r['init_s']:.1f}" if r.get("init_s") is not None else "-"
        tok = f"{r['tok_s']:.1f}" if r.get("tok_s") is not None else "-"
        click.echo(
            f"{name:<18}{r.get('from')!s:<28}{r['ready_s']:>8.1f}{ratio:>7.2f}{load:>8}{gbps:>7}"
            f"{init:>8}{tok:>8}  {r.get('compile_cache', '-')}"
        )
    for name, r in rows.items():
        if r.get("after_source_s") is not None and base["ready_s"]:
            after = r["after_source_s"]
            click.echo(
                f"{name}: Ready {after:.1f} s after its source; / auto's cold start "
                f"{after / base['ready_s']:.2f}"
            )
    own, preload = rows.get("own image"), rows.get("preload")
    if own and preload and preload["ready_s"]:
        share = own["ready_s"] / preload["ready_s"]
        click.echo(
            f"own image: Ready {own['ready_s']:.1f} s (its copy {own['copy_s']:.2f} s) / preload "
            f"{preload['ready_s']:.1f} s = {share:.3f} (goal: at most 1.05)"
        )
    for name in ("preload", "own image"):
        if rows.get(name, {}).get("steps"):
            marks = ", ".join(f"{k} {v:.1f}" for k, v in rows[name]["steps"].items())
            click.echo(f"{name} worker marks (s after launch): {marks}")
    for name, r in rows.items():
        if r.get("phases"):
            steps = ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
            click.echo(f"{name} load steps (s): {steps}")


def alternating_pairs(
    python: Path, model: Path, workdir: Path, timeout: float, args: list[str], pairs: int
) -> list[dict[str, float]]:
    """`pairs` more (preload, own image) starts back to back, the order alternating: on a
    shared, noisy machine one run's two rows can differ by 3x either way; the median of the
    pairs' ratios is the comparison."""
    from weightlift.bench.own_image import release_copies

    out = []
    for i in range(pairs):
        seconds: dict[str, float] = {}
        for who in ("own image", "preload") if i % 2 == 0 else ("preload", "own image"):
            if who == "preload":
                row, handle = run_worker(
                    python, model, workdir, Role.SOURCE, [], timeout, args, f"pair-{i}"
                )
            else:
                row, handle = run_own_image(model, workdir, timeout, args, f"own-image-{i}")
            _stop(handle[0])
            release_copies()
            seconds[who] = row["ready_s"]
        out.append({**seconds, "ratio": seconds["own image"] / seconds["preload"]})
    return out


def _print_pairs(
    python: Path, model: Path, work: Path, timeout: float, args: list[str], pairs: int
) -> list[dict[str, float]]:
    from statistics import median

    out = alternating_pairs(python, model, work, timeout, args, pairs)
    for i, pair in enumerate(out):
        click.echo(
            f"pair {i}: own image {pair['own image']:.1f} s / preload {pair['preload']:.1f} s"
            f" = {pair['ratio']:.3f}"
        )
    ratios = [p["ratio"] for p in out]
    click.echo(
        f"own image / preload over {len(out)} pairs: median {median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f} (goal: at most 1.05)"
    )
    return out


def _print_scale_ups(ups: dict[str, JSON], auto_ready_s: float) -> dict[str, JSON]:
    """Each scale-up's seconds from the scale patch to Ready, / auto's cold start (lower is
    better: 0.15 is the goal for a spare)."""
    click.echo(f"{'scale-up':<22}{'ready s':>8}{'/ auto':>8}  replica, loaded from")
    out: dict[str, JSON] = {}
    for name, up in ups.items():
        share = up["ready_s"] / auto_ready_s if auto_ready_s else None
        out[name] = {**up, "of_auto": round(share, 3) if share is not None else None}
        spare = " (the spare's own pod)" if up["was_spare"] else ""
        click.echo(
            f"{name:<22}{up['ready_s']:>8.1f}{share or 0:>8.2f}  "
            f"{up['replica']}{spare}, {up['loaded_from']}"
        )
    return out
