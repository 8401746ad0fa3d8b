"""Child processes of the local stack: tie them to their parent, stop them, find them again.

Every child runs in its own session (process group), so a stop reaches its grandchildren too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Self

_PR_SET_PDEATHSIG = 1
try:  # loaded in the parent: a preexec_fn must not dlopen after fork (the loader lock)
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not glibc
    _LIBC = None


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn`: the kernel sends `sig` to the child when the thread that started it exits
    (Linux PR_SET_PDEATHSIG), so a killed parent leaves nothing behind."""

    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig))

    return preexec


def child_options(
    log: IO[bytes],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    die_with: signal.Signals | None = None,
) -> dict[str, Any]:
    """`subprocess.Popen`/`run` options every child of the local stack starts with: no stdin,
    stdout and stderr into `log`, its own session (so a stop reaches its children) and, with
    `die_with`, that signal when the parent thread exits."""
    return {
        "stdin": subprocess.DEVNULL,
        "stdout": log,
        "stderr": subprocess.STDOUT,
        "start_new_session": True,
        "cwd": cwd,
        "env": env,
        "preexec_fn": die_with_parent(die_with) if die_with is not None else None,
    }


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send `sig` to the process group `proc` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def stop_group(
    proc: subprocess.Popen[bytes], grace: float, first: signal.Signals = signal.SIGTERM
) -> None:
    """`first` (SIGTERM) to the group, SIGKILL after `grace` seconds, then SIGKILL whatever is
    left of the group (grandchildren); `proc` is reaped."""
    signal_group(proc, first)
    try:
        proc.wait(timeout=max(grace, 0.1))
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()
    signal_group(proc, signal.SIGKILL)


def pid_runs(pid: int, exe: str) -> bool:
    """`pid` is alive (not a zombie) and runs `exe`: a recorded pid that was reused by another
    program is not ours to signal."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    return bool(cmdline) and cmdline[0].decode(errors="replace") == exe


def stop_pid(pid: int, exe: str, grace: float) -> None:
    """Like `stop_group` for a process another command started (known by a pid file, not a
    Popen): SIGTERM, SIGKILL after `grace` seconds, each only while it still runs `exe`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not pid_runs(pid, exe):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pid_runs(pid, exe):
            time.sleep(0.05)


class UpDown:
    """A context manager for a stack with `up()` and `down()`: entering runs `up()`, and a
    failed `up()` is undone by `down()` before the error goes on; leaving runs `down()`."""

    def up(self) -> object:
        raise NotImplementedError

    def down(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def pid_alive(pid: int) -> bool:
    """A process of that id exists (signal 0; one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
