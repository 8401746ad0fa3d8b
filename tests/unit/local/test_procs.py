"""Child processes of the local stack: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.e2e import alive
from weightlift.local.procs import die_with_parent, pid_runs, stop_group, stop_pid

# Ignores SIGTERM, starts a grandchild in its own group, prints both pids, then sleeps.
STUBBORN = (
    "import os, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(os.getpid(), kid.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_stop_group_kills_a_child_that_ignores_sigterm_and_its_children() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    _, grandchild = map(int, proc.stdout.readline().split())
    t0 = time.monotonic()
    stop_group(proc, grace=0.5)
    waited = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL  # SIGTERM was ignored, SIGKILL after the grace
    assert waited >= 0.5
    assert _gone(grandchild), "the grandchild outlived its group"


def test_stop_group_lets_a_polite_child_exit_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    time.sleep(0.3)  # past interpreter start-up
    stop_group(proc, grace=30)
    assert proc.returncode == -signal.SIGTERM


def test_die_with_parent_delivers_the_chosen_signal(tmp_path: Path) -> None:
    """A middle process starts a child with die_with_parent(SIGTERM) and exits: the child gets
    SIGTERM (it records which signal) and dies."""
    record = tmp_path / "signal"
    child = (
        "import signal, sys, time\n"
        f"def on(sig, _): open({str(record)!r}, 'w').write(str(sig)); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    middle = (
        "import signal, subprocess, sys\n"
        "from weightlift.local.procs import die_with_parent\n"
        f"kid = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE,\n"
        "                       preexec_fn=die_with_parent(signal.SIGTERM))\n"
        "kid.stdout.readline()\n"
        "print(kid.pid, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", middle], capture_output=True, text=True, timeout=60, check=True
    )
    kid = int(out.stdout.split()[-1])
    assert _gone(kid), "the child outlived its parent"
    assert record.read_text() == str(int(signal.SIGTERM))
    assert callable(die_with_parent(signal.SIGKILL))


def test_stop_pid_checks_the_program_before_signalling() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        # Popen returns once exec has begun, but the kernel sets the new argv a moment later
        # (/proc/PID/cmdline reads empty until then): wait for it, briefly.
        deadline = time.monotonic() + 10
        while not pid_runs(proc.pid, sys.executable) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pid_runs(proc.pid, sys.executable)
        # A pid file that names another program: the pid is not ours, nothing is sent.
        assert not pid_runs(proc.pid, "/usr/bin/not-this-program")
        stop_pid(proc.pid, "/usr/bin/not-this-program", grace=0.1)
        assert proc.poll() is None
        stop_pid(proc.pid, sys.executable, grace=10)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert not pid_runs(proc.pid, sys.executable)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
