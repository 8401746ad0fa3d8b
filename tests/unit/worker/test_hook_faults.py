"""Init hook libraries that crash or hang, in a real `weightlift worker` process: the worker
never serves, and what it leaves behind (its termination message, which the operator shows in
status) names the library."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.worker import copy_model, make_plan, plan_env
from weightlift.bench.chaos import HANGING_HOOK, SEGFAULT_HOOK
from weightlift.local.models import DemoModel, build_hook_library

# A wait for the process to end, not a speed check (imports crawl on a loaded 2-core box).
EXIT_DEADLINE = 240


def _run_worker(model: Path, library: str, tmp_path: Path) -> tuple[int, str]:
    plan = make_plan(model, initHooks={"library": library}, loading={"loadTimeoutSeconds": 10})
    term = tmp_path / "termination-log"
    env = dict(
        os.environ,
        **plan_env(plan, tmp_path),
        WEIGHTLIFT_TERMINATION_LOG=str(term),
        WEIGHTLIFT_FAIL_LINGER_SECONDS="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightlift", "worker"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        code = proc.wait(EXIT_DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, term.read_text() if term.exists() else ""


def test_segfaulting_hook_leaves_a_message_naming_the_library(
    demo_tp1: DemoModel, tmp_path: Path
) -> None:
    d = copy_model(demo_tp1.out, tmp_path / "m")
    build_hook_library(d / "hooks" / "libsegv.so", SEGFAULT_HOOK)
    code, message = _run_worker(d, "hooks/libsegv.so", tmp_path)
    assert code == -signal.SIGSEGV
    assert "the worker died inside init hook hooks/libsegv.so" in message
    assert "triton_pytorch_model_init" in message


def test_hanging_hook_fails_after_the_load_timeout_naming_the_library(
    demo_tp1: DemoModel, tmp_path: Path
) -> None:
    d = copy_model(demo_tp1.out, tmp_path / "m")
    build_hook_library(d / "hooks" / "libhang.so", HANGING_HOOK)
    code, message = _run_worker(d, "hooks/libhang.so", tmp_path)
    assert code == 1
    assert "init hook hooks/libhang.so" in message
    assert "did not return within 10s" in message


def test_a_hook_that_returns_leaves_no_message(demo_tp1: DemoModel, tmp_path: Path) -> None:
    """The last words are taken back once the library returns: a later clean exit says nothing
    about hooks (the SIGTERM test covers the full run; here the hook itself fails later)."""
    d = copy_model(demo_tp1.out, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\0" * 4)  # fails after the hook, in loading
    code, message = _run_worker(d, "hooks/libinit.so", tmp_path)
    assert code == 1
    assert "died inside" not in message and "model.safetensors" in message
