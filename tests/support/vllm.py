"""The real vLLM (CPU build) for tests: its environment, a tiny model, settings for 2 cores.

`make test` builds the environment (hack/install-vllm.sh) and sets WEIGHTLIFT_REQUIRE_VLLM: then a
missing environment fails the vLLM tests instead of skipping them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from weightlift.api.worker import WorkerPlan
from weightlift.local.llm import make_in_engine_env, vllm_python
from weightlift.local.stack import VLLM_ENGINE_ARGS, VLLM_ENV

REQUIRE_ENV = "WEIGHTLIFT_REQUIRE_VLLM"
# Small and quick on a 2-core box: one process for API server and engine, no compilation.
ENGINE_ARGS = VLLM_ENGINE_ARGS
ENGINE_ENV = VLLM_ENV
# vLLM start to ready is 30-40 s on 2 idle cores (imports dominate), minutes on a busy box:
# generous, never the thing under test.
READY_TIMEOUT = 900.0
# pytest-timeout for a test that starts vLLM a few times.
TEST_TIMEOUT = 2400


def require_vllm_python() -> Path:
    python = vllm_python()
    if python is not None and python.exists():
        return python
    msg = "the vLLM environment is missing; run `make vllm-env` (hack/install-vllm.sh)"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{msg} [{REQUIRE_ENV} is set]", pytrace=False)
    pytest.skip(msg)


def vllm_worker_env() -> dict[str, str]:
    """What worker processes need to start vLLM (nothing when its environment is missing: the
    vLLM tests then skip or fail on their own)."""
    python = vllm_python()
    return {"WEIGHTLIFT_VLLM_PYTHON": str(python)} if python is not None else {}


def tiny_llm(python: Path, out: Path) -> dict[str, Any]:
    """The tiny Llama (made once per directory) and its completion probe."""
    return make_in_engine_env(python, out)


class VllmWorker:
    """A weightlift worker process running vLLM beside itself, from a WorkerPlan file, with its
    own engine dir (and vLLM cache root, when given)."""

    def __init__(
        self,
        plan: WorkerPlan,
        workdir: Path,
        python: Path,
        *,
        cache_root: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.plan = plan
        self.address = f"127.0.0.1:{plan.runtime.port}"
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        plan_file = workdir / f"{plan.pod_name}.plan.json"
        plan_file.write_text(plan.model_dump_json(by_alias=True))
        full_env = {
            **os.environ,
            **ENGINE_ENV,
            "WEIGHTLIFT_VLLM_PYTHON": str(python),
            "WEIGHTLIFT_ENGINE_DIR": str(workdir),
            "WEIGHTLIFT_FAIL_LINGER_SECONDS": "0",
            **({"VLLM_CACHE_ROOT": str(cache_root)} if cache_root is not None else {}),
            **(env or {}),
        }
        self.log = workdir / f"{plan.pod_name}.worker.log"
        argv = [sys.executable, "-m", "weightlift", "worker", "--plan", str(plan_file)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def vllm_log(self) -> str:
        return (self.workdir / self.plan.pod_name / "vllm.log").read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = httpx.get(
            f"http://{self.address}/weightlift/v1/status", timeout=5
        ).json()
        return doc

    def wait_serving(self) -> dict[str, Any]:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"worker exited:\n{self.log.read_text()[-3000:]}"
            try:
                st = self.status()
                if st["phase"] == "Serving":
                    return st
                assert st["phase"] != "Failed", st
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not serving in {READY_TIMEOUT}s:\n{self.log.read_text()[-3000:]}")

    def stop(self, grace: float = 60.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
