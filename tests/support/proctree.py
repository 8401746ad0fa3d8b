"""Every process the workers started, recorded while they ran, and the check that none is left.

A `ProcessRecorder` scans the process table from a thread every `interval` seconds (and once
more on demand, right before a teardown). Each scan records every root (a worker process: the
node's pids) and every process below it: its descendants, and whatever is still in a root's
session (a worker leads its own session, `start_new_session`, and an orphan re-parented to init
keeps it). A process is known by pid AND start time, so a reused pid is never taken for a
survivor, and a recorded process is remembered after its parent died. After teardown not one
recorded process may run (a zombie counts as gone).

psutil is not installed in the venv (no dependency of ours pulls it in), and one pass over
/proc/*/stat gives all this needs (parent, session, start time, state): so this reads /proc.
What it cannot see: a process that starts and leaves the worker's tree AND session between two
scans (a double-forked daemon that calls setsid within `interval`); anything that lives through
one scan below a worker is recorded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

Roots = Callable[[], Mapping[str, Iterable[int]]]


@dataclass(frozen=True)
class Proc:
    """A process as recorded: pid and start time name it; `owner` is the root's key (the
    pod's namespace/name) it was found under, `cmd` its command line when first seen (a child
    caught between fork and exec still shows its parent's)."""

    pid: int
    start: int  # /proc/PID/stat field 22, clock ticks since boot
    owner: str = field(compare=False)
    cmd: str = field(compare=False)

    def command(self) -> str:
        """Its command line now while it runs, else as recorded."""
        return _cmdline(self.pid) if runs(self) else self.cmd

    def __str__(self) -> str:
        return f"pid {self.pid} of {self.owner}: {self.command()}"


@dataclass(frozen=True)
class _Stat:
    state: str
    ppid: int
    sid: int
    start: int


def _stat(pid: int) -> _Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone
        return None
    # "pid (comm) state ppid pgrp session ... starttime": comm may hold spaces and parentheses
    f = text.rsplit(")", 1)[1].split()
    return _Stat(state=f[0], ppid=int(f[1]), sid=int(f[3]), start=int(f[19]))


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300] or "?"


def process_table() -> dict[int, _Stat]:
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = st
    return table


def runs(p: Proc) -> bool:
    """`p` (that pid with that start time) still runs: not gone, not a zombie."""
    st = _stat(p.pid)
    return st is not None and st.start == p.start and st.state not in ("Z", "X")


def wait_none_run(procs: Iterable[Proc], timeout: float) -> list[Proc]:
    """Wait until none of `procs` runs (a dead process never runs again: its pid may come back
    only with another start time); what still runs after `timeout` seconds."""
    left = [p for p in procs if runs(p)]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if runs(p)]
    return left


class ProcessRecorder:
    """Records `roots()` (key -> pids) and everything below them, every `interval` seconds
    from `start()` until `stop()`, and on each `record()`."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.errors: list[str] = []  # a scan that raised: the record is then incomplete
        self._roots: Roots | None = None
        self._seen: dict[Proc, Proc] = {}
        self._leaders: dict[int, Proc] = {}  # session id -> the recorded root leading it
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, roots: Roots) -> None:
        self._roots = roots
        self.record()
        self._thread = threading.Thread(target=self._loop, name="proc-recorder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self.record()
            except Exception as exc:  # kept: the check after teardown reports it
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def record(self) -> None:
        """One scan: the roots, their descendants and their sessions' members, as they run now."""
        if self._roots is None:
            return
        roots = {key: list(pids) for key, pids in self._roots().items()}
        table = process_table()
        found: dict[int, str] = {}
        with self._lock:
            for key, pids in roots.items():
                for pid in pids:
                    st = table.get(pid)
                    if st is None:
                        continue
                    found[pid] = key
                    if st.sid == pid:
                        self._leaders[pid] = Proc(pid, st.start, key, "")
            leaders = dict(self._leaders)
        for pid, st in table.items():
            leader = leaders.get(st.sid)
            if leader is not None and st.start >= leader.start:
                found.setdefault(pid, leader.owner)
        children: dict[int, list[int]] = {}
        for pid, st in table.items():
            children.setdefault(st.ppid, []).append(pid)
        todo = list(found)
        while todo:
            parent = todo.pop()
            for child in children.get(parent, ()):
                if child not in found:
                    found[child] = found[parent]
                    todo.append(child)
        with self._lock:
            for pid, owner in found.items():
                p = Proc(pid, table[pid].start, owner, "")
                if p not in self._seen:
                    self._seen[p] = Proc(pid, p.start, owner, _cmdline(pid))

    def seen(self, owner: Callable[[str], bool] = lambda _: True) -> list[Proc]:
        """Every process recorded so far whose owner key `owner` accepts."""
        with self._lock:
            return sorted((p for p in self._seen.values() if owner(p.owner)), key=str)
