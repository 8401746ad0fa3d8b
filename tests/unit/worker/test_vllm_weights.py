"""The vLLM load format's weight path without vLLM: a rank's parameters from storage through a
stand-in for vLLM's load_weights, from a real NIXL peer's same rank (a PublishedRank in this
process), fallback when the peer is gone or holds other tensors, reports, command."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.p2p import needs_nixl
from weightlift.api.model import ModelFormat, ModelSource, Role, RuntimeSpec
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.worker.engines.vllm.engine import engine_host, vllm_command, vllm_environment
from weightlift.worker.engines.vllm.ranks import (
    COMPILE_FIRST_ENV,
    EngineRankReport,
    ModelDirError,
    check_model_dir,
    read_report,
    write_report,
)
from weightlift.worker.engines.vllm.serve import NOT_INSTALLED_EXIT
from weightlift.worker.engines.vllm.weights import (
    PublishedRank,
    RankLoad,
    load_checkpoint,
    load_rank,
)
from weightlift.worker.weights.tensors import all_bit_equal


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-layout directory: config.json, tokenizer.json, model.safetensors (mixed dtypes)."""
    d = tmp_path_factory.mktemp("hf")
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=gen).half(),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=gen),
    }
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "tokenizer.json").write_text("{}")
    return d


LAYOUT = "vLLM 0.32.0"  # what the engine loader passes (loader.LAYOUT), as if in vLLM 0.32


def plan_for(
    d: Path,
    pod: str,
    role: Role = Role.SOURCE,
    peers: list[PeerCandidate] | None = None,
    tp: int = 1,
) -> WorkerPlan:
    return WorkerPlan(
        deployment="llm",
        pod_name=pod,
        model_identity="llm-ident",
        model=ModelSource(uri=f"file://{d}", format=ModelFormat.SAFETENSORS, dtype="bfloat16"),
        model_dir=str(d),
        served_model_name="llm",
        tensor_parallel=tp,
        ranks=list(range(tp)),
        device="cpu",
        role=role,
        peers=peers or [],
        runtime=RuntimeSpec(engine="vLLM", engine_port=18123, engine_args=["--enforce-eager"]),
    )


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "config.json not found"),
        ("model.safetensors", r"no \*.safetensors"),
        ("tokenizer.json", "no tokenizer.json"),
    ],
)
def test_model_dir_checks_name_what_is_missing(
    hf_dir: Path, tmp_path: Path, remove: str, message: str
) -> None:
    for f in hf_dir.iterdir():
        if f.name != remove:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelDirError, match=message) as err:
        check_model_dir(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert err.value.permanent
    assert check_model_dir(hf_dir) == hf_dir


def test_source_loads_the_checkpoint_as_stored_whatever_tp_and_dtype(hf_dir: Path) -> None:
    # tp 2 and a bfloat16 serving dtype: the checkpoint is still one 'rank' with stored dtypes;
    # vLLM slices and casts in its own load_weights.
    loaded = load_checkpoint(plan_for(hf_dir, "src", tp=2))
    assert loaded.progress.loaded_from == "storage:file"
    assert all_bit_equal(loaded.tensors, load_file(str(hf_dir / "model.safetensors")))
    assert loaded.progress.bytes_loaded == sum(
        t.numel() * t.element_size() for t in loaded.tensors.values()
    )


def rank_params(tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's model would hold on `rank` of `tp` for hf_dir: bfloat16, q_proj's rows split
    across ranks, embed and lm_head fused into one parameter (a stand-in for qkv stacking)."""
    return {
        "embed_head.weight": torch.zeros(2, 64, 32, dtype=torch.bfloat16),
        "q.weight": torch.zeros(32 // tp, 32, dtype=torch.bfloat16),
        "norm.weight": torch.zeros(32, dtype=torch.bfloat16),
    }


def feeder(params: dict[str, torch.Tensor], tp: int, rank: int, calls: list[int]) -> Any:
    """A stand-in for vLLM's model.load_weights: stack, slice this rank's rows, cast."""

    def feed(ckpt: dict[str, torch.Tensor]) -> None:
        calls.append(rank)
        rows = 32 // tp
        with torch.no_grad():
            params["embed_head.weight"].copy_(
                torch.stack([ckpt["model.embed_tokens.weight"], ckpt["lm_head.weight"]])
            )
            q = ckpt["model.layers.0.self_attn.q_proj.weight"]
            params["q.weight"].copy_(q[rank * rows : (rank + 1) * rows])
            params["norm.weight"].copy_(ckpt["model.norm.weight"])

    return feed


def load_as(
    d: Path,
    pod: str,
    peers: list[PeerCandidate] | None,
    tp: int,
    rank: int,
    layout: str = LAYOUT,
) -> tuple[RankLoad, dict[str, torch.Tensor], list[int]]:
    """load_rank for fresh parameters: a Source without peers, else a Target; returns the load,
    the parameters and the ranks whose load_weights stand-in ran."""
    params: dict[str, torch.Tensor] = rank_params(tp, rank)
    calls: list[int] = []
    role = Role.TARGET if peers else Role.SOURCE
    plan = plan_for(d, pod, role, peers, tp=tp)
    loaded = load_rank(plan, rank, params, feeder(params, tp, rank, calls), layout=layout)
    return loaded, params, calls


@needs_nixl
def test_target_rank_pulls_only_its_parameters_then_falls_back(hf_dir: Path) -> None:
    tp, rank = 2, 1
    source, src_params, calls = load_as(hf_dir, "src", None, tp, rank)
    assert source.progress.loaded_from == "storage:file" and calls == [rank]
    assert all_bit_equal(source.published, src_params)
    expected = {k: v.clone() for k, v in src_params.items()}
    for p in src_params.values():  # vLLM's processing repacks and empties the parameters
        p.zero_()
    published = PublishedRank(plan_for(hf_dir, "src", tp=tp), rank, source.published, LAYOUT)
    try:
        peers = [PeerCandidate(pod="src", address=published.address)]
        target, tgt_params, calls = load_as(hf_dir, "tgt", peers, tp, rank)
        assert target.strategy == "p2p" and calls == []
        assert target.progress.loaded_from == "peer:src"
        assert target.progress.transport and "unknown" not in target.progress.transport
        assert all_bit_equal(tgt_params, expected)  # the pre-processing values, not the zeros
        assert all_bit_equal(target.published, expected)  # and it publishes what it pulled
        # Only this rank's parameters moved: half of q_proj, not the checkpoint.
        assert target.progress.bytes_loaded == sum(
            t.numel() * t.element_size() for t in expected.values()
        )
        assert published.publisher.health()["completed_reads"] == 1
        assert b'"layout":"vLLM 0.32.0"' in published.publisher.ranks[rank].manifest_body
        # A target whose parameters differ (another TP size) refuses the peer's, loads storage.
        mismatch, _, calls = load_as(hf_dir, "tgt", peers, 1, 0)
        assert mismatch.progress.loaded_from == "storage:file" and calls == [0]
        assert mismatch.peer_failures and "src" in mismatch.peer_failures[0]
        # So does one of another vLLM version: same names and shapes, maybe not the same meaning.
        other, _, calls = load_as(hf_dir, "tgt", peers, tp, rank, layout="vLLM 0.31.0")
        assert other.progress.loaded_from == "storage:file" and calls == [rank]
        assert "laid out by vLLM 0.32.0, ours by vLLM 0.31.0" in other.peer_failures[0]
    finally:
        published.close()
    # The source is gone: the target still loads, from storage, and says why.
    fallback, tgt_params, calls = load_as(hf_dir, "tgt", peers, tp, rank)
    assert fallback.progress.loaded_from == "storage:file" and calls == [rank]
    assert fallback.peer_failures and "src" in fallback.peer_failures[0]
    assert all_bit_equal(tgt_params, expected)


def test_reports_round_trip_and_missing_is_none(tmp_path: Path) -> None:
    assert read_report(tmp_path, 0) is None
    write_report(tmp_path, EngineRankReport(rank=1, ok=False, message="rank 1: boom"))
    got = read_report(tmp_path, 1)
    assert got is not None and not got.ok and got.message == "rank 1: boom"


def test_vllm_command_carries_plan_port_tp_and_user_args(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_for(hf_dir, "p", tp=2)
    cmd = vllm_command(plan, tmp_path / "plan.json", tmp_path / "reports")
    assert cmd[1:3] == ["-m", "weightlift.worker.engines.vllm.serve"]
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert args["--model"] == str(hf_dir) and args["--port"] == "18123"
    assert args["--tensor-parallel-size"] == "2" and args["--load-format"] == "weightlift"
    extra = json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])
    assert extra == {
        "plan": str(tmp_path / "plan.json"),
        "reportDir": str(tmp_path / "reports"),
        "compileFirst": False,
    }
    assert cmd[-1] == "--enforce-eager"
    # Standby: each rank's weight step waits for the file the worker relays the hand-off to.
    cmd = vllm_command(plan, tmp_path / "plan.json", tmp_path / "reports", tmp_path / "h.json")
    extra = json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])
    assert extra["handoff"] == str(tmp_path / "h.json")
    # Eager: nothing to compile first; the ranks wait at their weight step.
    assert extra["compileFirst"] is False
    # Compiled, a standby target: it installs its source's program after the hand-off.
    compiled = plan.model_copy(
        update={"runtime": plan.runtime.model_copy(update={"engine_args": []})}
    )
    cmd = vllm_command(compiled, tmp_path / "plan.json", tmp_path / "reports", tmp_path / "h.json")
    assert json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])["compileFirst"] is False
    # Compiled, a warm spare: after vLLM compiled and warmed up on placeholders, unless the env
    # opts out.
    compiled = compiled.model_copy(update={"spare": True})
    cmd = vllm_command(compiled, tmp_path / "plan.json", tmp_path / "reports", tmp_path / "h.json")
    assert json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])["compileFirst"] is True
    monkeypatch.setenv(COMPILE_FIRST_ENV, "0")
    cmd = vllm_command(compiled, tmp_path / "plan.json", tmp_path / "reports", tmp_path / "h.json")
    assert json.loads(cmd[cmd.index("--model-loader-extra-config") + 1])["compileFirst"] is False


def test_vllm_listens_where_only_the_worker_reaches_it(hf_dir: Path, tmp_path: Path) -> None:
    """A real pod (the worker on every address): vLLM on the pod's loopback. The process node
    (the worker on its own 127.0.x.y): vLLM there too; its API key keeps others out."""
    assert engine_host("0.0.0.0") == engine_host("::") == "127.0.0.1"
    assert engine_host("127.0.3.4") == "127.0.3.4"
    plan = plan_for(hf_dir, "p", tp=1)
    cmd = vllm_command(plan, tmp_path / "plan.json", tmp_path / "reports")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--api-key" not in cmd  # the key travels in vLLM's environment, not its argv


def test_vllm_environment_puts_this_checkout_first_on_the_engines_import_path() -> None:
    """The engine's venv is shared per machine: its editable weightlift may name another
    checkout; vLLM's processes must import the weightlift the worker runs."""
    import weightlift

    root = str(Path(weightlift.__file__).resolve().parents[1])
    env = vllm_environment({"PYTHONPATH": f"/elsewhere{os.pathsep}{root}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    assert vllm_environment({})["PYTHONPATH"] == root


def test_vllm_environment_keeps_our_plugin_in_an_allow_list() -> None:
    env = vllm_environment({"VLLM_PLUGINS": "other", "WEIGHTLIFT_VLLM_PYTHON": "/x/python"})
    assert env["VLLM_PLUGINS"] == "other,weightlift"
    assert "WEIGHTLIFT_VLLM_PYTHON" not in env
    assert "VLLM_PLUGINS" not in vllm_environment({})  # unset means every plugin loads


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_without_vllm_says_so_and_where() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightlift.worker.engines.vllm.serve", "--model", "/nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == NOT_INSTALLED_EXIT
    assert "vLLM is not installed" in done.stderr and sys.executable in done.stderr


_GRANDCHILD = """
import os, sys, time
from weightlift.worker.engines.vllm.plugin import die_with_parent_if_asked
die_with_parent_if_asked()
print(os.getpid(), flush=True)
time.sleep(120)
"""

_PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {_GRANDCHILD!r}])
time.sleep(120)
"""


def _grandchild_after_parent_killed(env: dict[str, str]) -> bool:
    """Start parent -> grandchild (the grandchild stands for vLLM's engine core, which the worker
    cannot arm itself), SIGKILL the parent, and say whether the grandchild is still alive."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        grandchild = 0
        while time.monotonic() < deadline and not grandchild:
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            grandchild = int(kids[0]) if kids else 0
            time.sleep(0.05)
        assert grandchild, "the parent never started its child"
        # The child arms the signal before it prints its pid: wait for that line.
        assert parent.stdout is not None
        assert int(parent.stdout.readline()) == grandchild
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{grandchild}/stat").read_text().split()[2]
            except FileNotFoundError:
                return False
            if state == "Z":
                return False
            time.sleep(0.05)
        os.kill(grandchild, signal.SIGKILL)
        return True
    finally:
        parent.kill()


def test_vllm_processes_started_by_the_worker_die_with_their_parent() -> None:
    env = vllm_environment(dict(os.environ))
    assert env["WEIGHTLIFT_VLLM_DIE_WITH_PARENT"] == "1"
    assert not _grandchild_after_parent_killed(env)
    # Outside the worker (a user's own `vllm serve`) nothing is armed: the orphan lives on.
    env.pop("WEIGHTLIFT_VLLM_DIE_WITH_PARENT")
    assert _grandchild_after_parent_killed(env)


async def test_forwarding_gives_vllm_the_workers_key_and_a_rank_the_callers_token(
    hf_dir: Path, tmp_path: Path
) -> None:
    """vLLM gets the key only the worker holds, never the caller's; a rank's manifest server
    gets the caller's peer token as it came (it checks it)."""
    from aiohttp import ClientSession, web

    from weightlift.local.net import free_port
    from weightlift.worker.engines.vllm.engine import VllmEngine

    seen: dict[str, str | None] = {}

    async def record(request: web.Request) -> web.Response:
        seen[request.host.split(":")[1]] = request.headers.get("Authorization")
        return web.json_response({"ok": True})

    upstream, front = web.Application(), web.Application()
    upstream.router.add_route("*", "/{tail:.*}", record)
    vllm_port, rank_port, front_port = free_port(), free_port(), free_port()
    plan = plan_for(hf_dir, "p").model_copy(update={"host": "127.0.0.1"})
    plan.runtime.engine_port = vllm_port
    engine = VllmEngine(plan, tmp_path)

    async def to_vllm(request: web.Request) -> web.StreamResponse:
        return await engine.forward(request, engine.url)

    async def to_rank(request: web.Request) -> web.StreamResponse:
        return await engine.forward(request, f"http://127.0.0.1:{rank_port}")

    front.router.add_post("/v1/completions", to_vllm)
    front.router.add_get("/weightlift/v1/p2p/manifest", to_rank)
    runners = [web.AppRunner(upstream), web.AppRunner(upstream), web.AppRunner(front)]
    try:
        for runner, port in zip(runners, (vllm_port, rank_port, front_port), strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        caller = {"Authorization": "Bearer callers-token"}
        async with ClientSession() as client:
            base = f"http://127.0.0.1:{front_port}"
            async with client.post(f"{base}/v1/completions", json={}, headers=caller) as r:
                assert r.status == 200
            async with client.get(f"{base}/weightlift/v1/p2p/manifest", headers=caller) as r:
                assert r.status == 200
    finally:
        await engine.close()
        for runner in runners:
            await runner.cleanup()
    assert seen[str(vllm_port)] == f"Bearer {engine.api_key}" != "Bearer callers-token"
    assert seen[str(rank_port)] == "Bearer callers-token"
