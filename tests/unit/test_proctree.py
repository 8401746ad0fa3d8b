"""The e2e tier's leak check (tests/support/proctree.py) on real processes: a worker's grandchild
that left its session outlives the worker's group kill and is reported; a tree that dies with
the group leaves nothing to report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.proctree import Proc, ProcessRecorder, runs, wait_none_run

KEY = "e2e/leaky-0"


@contextlib.contextmanager
def worker(script: str) -> Iterator[subprocess.Popen[str]]:
    """A stand-in for a worker: bash leading its own session, as the process node starts one."""
    proc = subprocess.Popen(
        ["bash", "-c", script],
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def recorder() -> Iterator[ProcessRecorder]:
    """A recorder whose processes are all killed afterwards, whatever the test found."""
    rec = ProcessRecorder(interval=0.05)
    try:
        yield rec
    finally:
        rec.stop()
        for p in rec.seen():
            if runs(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)


def record_until(recorder: ProcessRecorder, commands: list[str]) -> list[Proc]:
    """The recorded processes once their command lines (sorted) are `commands` (each past its
    exec), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while sorted(p.command() for p in recorder.seen()) != commands:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return recorder.seen()


def test_a_grandchild_in_another_session_outlives_the_group_kill_and_is_reported(
    recorder: ProcessRecorder,
) -> None:
    # The sleeper under setsid left the worker's session and group: killpg does not reach it.
    script = "setsid sleep 300 & sleep 300 & echo ready; wait"
    with worker(script) as proc:
        recorder.start(lambda: {KEY: [proc.pid]} if proc.poll() is None else {})
        seen = record_until(recorder, ["bash -c " + script, "sleep 300", "sleep 300"])
        recorder.stop()
        assert sorted(p.command() for p in seen) == ["bash -c " + script, "sleep 300", "sleep 300"]
        assert {p.owner for p in seen} == {KEY}, seen
        os.killpg(proc.pid, signal.SIGKILL)  # what the node's stop does
        proc.wait()
    left = wait_none_run(seen, timeout=2)
    assert len(left) == 1 and left[0].command() == "sleep 300", left
    assert os.getsid(left[0].pid) == left[0].pid  # the setsid one
    os.kill(left[0].pid, signal.SIGKILL)
    assert wait_none_run(left, timeout=5) == []


def test_a_tree_that_dies_with_its_group_leaves_nothing(recorder: ProcessRecorder) -> None:
    script = "sleep 300 & (sleep 300 & wait) & echo ready; wait"
    with worker(script) as proc:
        recorder.start(lambda: {KEY: [proc.pid]})
        # bash, its sleep, the subshell (a bash fork: the same command line) and its sleep
        seen = record_until(recorder, 2 * ["bash -c " + script] + 2 * ["sleep 300"])
        recorder.stop()
        assert len(seen) == 4, seen
    assert wait_none_run(seen, timeout=5) == []
    assert not recorder.errors


def test_an_orphan_left_in_the_workers_session_is_recorded_after_its_parent_died(
    recorder: ProcessRecorder,
) -> None:
    """The subshell exits before any scan sees the sleeper it started: the sleeper is re-parented
    (to init), out of the worker's tree, but still in the worker's session."""
    script = "echo ready; read go; (sleep 300 &); echo spawned; wait"
    with worker(script) as proc:
        recorder.interval = 3600  # no scans but the ones asked for here
        recorder.start(lambda: {KEY: [proc.pid]})
        assert [p.pid for p in recorder.seen()] == [proc.pid]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "spawned"
        recorder.record()
        recorder.stop()
        orphans = [p for p in recorder.seen() if p.pid != proc.pid]
        assert [p.owner for p in orphans] == [KEY], recorder.seen()
        # re-parented out of the worker's tree, still in its session
        assert os.getsid(orphans[0].pid) == proc.pid
        assert Path(f"/proc/{orphans[0].pid}/stat").read_text().split(") ")[1].split()[1] != str(
            proc.pid
        )
        deadline = time.monotonic() + 5  # it may be caught between fork and exec
        while orphans[0].command() != "sleep 300" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orphans[0].command() == "sleep 300"
    assert wait_none_run(recorder.seen(), timeout=5) == []


def test_a_reused_pid_is_not_a_survivor() -> None:
    me = Proc(os.getpid(), 0, KEY, "not this process: another start time")
    assert not runs(me)
