"""Bad input for a vLLM replica, caught by the worker before (or without) a vLLM start-up: each
fails the worker permanently with a message naming what and where, and it never serves."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.worker import free_port, make_plan, running_worker
from weightlift.api.model import InitHooks
from weightlift.api.worker import WorkerPlan
from weightlift.local.models import build_hook_library
from weightlift.worker.engines.vllm.engine import VllmEngine
from weightlift.worker.engines.vllm.ranks import (
    EngineRankReport,
    write_report,
)
from weightlift.worker.engines.vllm.weights import (
    run_rank_hooks,
)
from weightlift.worker.hooks import INIT_SYMBOL, HookError

VOCAB = 64


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """config.json (vocab 64), a tokenizer.json whose ids fit, model.safetensors."""
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 8)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    _tokenizer(d, VOCAB)
    return d


def _tokenizer(d: Path, n: int) -> None:
    vocab = {f"t{i}": i for i in range(n - 1)}
    added = [{"id": n - 1, "content": "</s>", "special": True}]
    (d / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": vocab}, "added_tokens": added})
    )


def _vllm_plan(d: Path, **extra: object) -> WorkerPlan:
    return make_plan(
        d,
        model={"uri": f"file://{d}", "format": "safetensors"},
        runtime={"engine": "vLLM", "port": free_port(), "enginePort": free_port()},
        **extra,
    )


def _failed_status(plan: WorkerPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("WEIGHTLIFT_ENGINE_DIR", str(tmp_path / "engine"))
    with running_worker(plan) as w:
        st = w.wait_phase({"Failed", "Serving"}, timeout=120)
    assert st["phase"] == "Failed", st
    assert st["permanentFailure"], st
    return st


def test_model_dir_without_config_json(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (hf_dir / "config.json").unlink()
    st = _failed_status(_vllm_plan(hf_dir), tmp_path, monkeypatch)
    assert "config.json not found" in st["message"] and str(hf_dir) in st["message"], st
    assert not (tmp_path / "engine").exists()  # vLLM was never started


def test_tokenizer_from_another_model(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tokenizer(hf_dir, 4 * VOCAB)  # ids up to 255 for a 64-row embedding
    st = _failed_status(_vllm_plan(hf_dir), tmp_path, monkeypatch)
    msg = st["message"]
    assert "tokenizer.json does not match" in msg and str(hf_dir) in msg, msg
    assert f"token id {4 * VOCAB - 1}" in msg and f"vocab_size is {VOCAB}" in msg, msg


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_not_installed_in_the_worker_environment(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTLIFT_VLLM_PYTHON", sys.executable)  # this venv: no vLLM
    st = _failed_status(_vllm_plan(hf_dir), tmp_path, monkeypatch)
    assert "vLLM is not installed" in st["message"] and sys.executable in st["message"], st


def test_hook_without_init_symbol_fails_the_rank_naming_library_and_symbol(
    hf_dir: Path, tmp_path: Path
) -> None:
    lib = build_hook_library(hf_dir / "hooks" / "libbad.so", "int other(void) { return 1; }\n")
    plan = _vllm_plan(hf_dir, initHooks={"library": "hooks/libbad.so", "required": True})
    assert plan.init_hooks == InitHooks(library="hooks/libbad.so", required=True)
    with pytest.raises(HookError) as err:
        run_rank_hooks(plan, 1)
    assert str(lib) in str(err.value) and INIT_SYMBOL in str(err.value)
    assert err.value.permanent
    # What the rank writes on that failure, as the worker turns it into its message.
    engine = VllmEngine(plan, tmp_path / "engine")
    write_report(
        engine.report_dir,
        EngineRankReport(rank=0, ok=False, message=f"rank 0: {err.value}", permanent=True),
    )
    failure = engine._failure("failed to load")
    assert failure.permanent and INIT_SYMBOL in str(failure) and str(lib) in str(failure)


def test_hooks_run_per_rank_with_the_rank_as_device_index(hf_dir: Path, tmp_path: Path) -> None:
    build_hook_library(hf_dir / "hooks" / "libinit.so")
    plan = _vllm_plan(hf_dir, initHooks={"library": "hooks/libinit.so", "required": True})
    session = run_rank_hooks(plan, 1)
    assert session is not None
    try:
        assert [(r.device_index, r.ok) for r in session.reports] == [(1, True)]
    finally:
        assert session.release() == []
    assert run_rank_hooks(_vllm_plan(hf_dir), 0) is None  # no hooks: nothing to run
