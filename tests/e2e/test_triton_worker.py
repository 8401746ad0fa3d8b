"""A Triton replica's bad input that only a real tritonserver reveals: the model repository
Triton refuses (here: engine arguments vLLM rejects inside Triton's Python backend) fails the
worker with a message naming tritonserver, the model, the repository and Triton's reason;
tritonserver is gone after it. One worker, no cluster; the stub's vLLM imports dominate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.triton import require_triton_home
from tests.support.vllm import ENGINE_ARGS, ENGINE_ENV, require_vllm_python, tiny_llm
from tests.support.worker import running_worker
from weightlift.api.model import Role
from weightlift.api.worker import WorkerPlan
from weightlift.local.llm import vllm_worker_plan

JSON = dict[str, Any]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JSON, Path, Path]:
    python = require_vllm_python()
    home = require_triton_home(python)
    out = tmp_path_factory.mktemp("triton-worker-llm")
    return out, tiny_llm(python, out), python, home


def _plan(model: Path, engine_args: list[str]) -> WorkerPlan:
    return vllm_worker_plan(model, "llm-0", Role.SOURCE, [], engine_args, triton=True)


def test_a_model_triton_refuses_fails_the_worker_naming_repository_and_reason(
    llm: tuple[Path, JSON, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, python, home = llm
    for key, value in {
        **ENGINE_ENV,
        "WEIGHTLIFT_VLLM_PYTHON": str(python),
        "WEIGHTLIFT_TRITON_HOME": str(home),
        "WEIGHTLIFT_ENGINE_DIR": str(tmp_path),
        "WEIGHTLIFT_FAIL_LINGER_SECONDS": "30",
    }.items():
        monkeypatch.setenv(key, value)
    plan = _plan(model, [*ENGINE_ARGS, "--no-such-engine-flag"])
    with running_worker(plan) as w:
        st = w.wait_phase({"Failed", "Serving"}, timeout=600)
        engine = w.worker.engine if w.worker is not None else None
    assert st["phase"] == "Failed", st
    msg = st["message"]
    repository = tmp_path / "llm-0" / "repository"
    assert "tritonserver" in msg and "refused model 'llm'" in msg, msg
    assert str(repository) in msg and "--no-such-engine-flag" in msg, msg
    assert (repository / "llm" / "config.pbtxt").is_file()
    # The worker stopped: its tritonserver is gone (it exits on a failed load; close() reaps it).
    process = getattr(engine, "process", None)
    assert process is not None and process.poll() is not None
