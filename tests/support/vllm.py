"""The real vLLM (CPU build) for tests: its environment, a tiny model, settings for 2 cores.

`make test` builds the environment (hack/install-vllm.sh) and sets WEIGHTLIFT_REQUIRE_VLLM: then a
missing environment fails the vLLM tests instead of skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

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
