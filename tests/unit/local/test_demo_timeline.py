"""The demo's per-replica timeline: each step's seconds from consecutive marks."""

from __future__ import annotations

from weightlift.local.observe import TIMELINE_STEPS, ReplicaTimes, replica_timeline
from weightlift.worker.p2p.target import PullResult


def test_steps_are_differences_of_consecutive_marks() -> None:
    seen = ReplicaTimes(first_seen=100.0, scheduled_at=100.5, ready_at=109.0)
    worker = {
        "process": 101.0,
        "server": 103.0,
        "fetch": 103.0,
        "hooks": 103.25,
        "load": 105.25,
        "bind": 105.5,
        "serving": 105.5,
    }
    got = replica_timeline(seen, worker)
    not_here = {"engine start", "vLLM processing", "standby", "wait for peers"}
    assert list(got) == [step for step, _ in TIMELINE_STEPS if step not in not_here]
    assert got["scheduling"] == 0.5
    assert got["process start"] == 0.5
    assert got["imports + server"] == 2.0
    assert got["hooks"] == 0.25
    assert got["load"] == 2.0
    assert got["probe"] == 3.5
    assert sum(got.values()) == 9.0  # created -> ready


def test_a_vllm_replica_shows_engine_start_hooks_load_and_processing() -> None:
    """vLLM's marks: engine (started and initialized up to its weight load), hooks and load
    inside the rank, processed (vLLM's own loading and post-processing); no bind."""
    seen = ReplicaTimes(first_seen=100.0, scheduled_at=100.5, ready_at=140.0)
    worker = {
        "process": 101.0,
        "server": 103.0,
        "fetch": 103.0,
        "engine": 128.0,
        "hooks": 128.5,
        "load": 129.0,
        "processed": 129.25,
        "serving": 139.0,
    }
    got = replica_timeline(seen, worker)
    assert "bind" not in got
    assert got["engine start"] == 25.0 and got["hooks"] == 0.5 and got["load"] == 0.5
    assert got["vLLM processing"] == 0.25 and got["serve"] == 9.75 and got["probe"] == 1.0
    assert sum(got.values()) == 40.0


def test_a_target_in_standby_shows_its_preparation_and_its_wait_for_peers() -> None:
    seen = ReplicaTimes(first_seen=100.0, scheduled_at=100.0, ready_at=112.0)
    worker = {
        "process": 100.0,
        "server": 103.0,
        "fetch": 103.0,
        "hooks": 103.5,
        "standby": 106.0,  # program opened, pull buffers faulted in
        "peers": 110.0,  # the hand-off file named a Ready source
        "load": 110.25,
        "bind": 110.5,
        "serving": 110.5,
    }
    got = replica_timeline(seen, worker)
    assert got["standby"] == 2.5 and got["wait for peers"] == 4.0 and got["load"] == 0.25
    assert sum(got.values()) == 12.0


def test_a_mark_out_of_order_is_folded_into_the_next_step() -> None:
    """A vLLM target waits for its peers before vLLM starts: the engine's marks come later."""
    seen = ReplicaTimes(first_seen=0.0, scheduled_at=0.0, ready_at=30.0)
    worker = {"process": 0.0, "server": 3.0, "standby": 3.0, "peers": 10.0, "engine": 25.0}
    worker |= {"hooks": 25.5, "load": 26.0, "serving": 29.0}
    got = replica_timeline(seen, worker)
    assert "standby" not in got and "wait for peers" not in got  # before hooks: folded
    assert got["engine start"] == 22.0
    assert sum(got.values()) == 30.0


def test_missing_marks_are_skipped_not_invented() -> None:
    seen = ReplicaTimes(first_seen=10.0, scheduled_at=None, ready_at=None)
    got = replica_timeline(seen, {"process": 11.0, "load": 14.0})
    assert got == {"process start": 1.0, "load": 3.0}


def test_pull_phases_are_durations() -> None:
    timings = {"manifest": 0.1, "alloc": 0.4, "agent": 0.5, "transfer_done": 1.5, "verified": 1.75}
    result = PullResult({}, None, 1.75, 1.0, 0, 0, "p", timings)  # type: ignore[arg-type]
    assert result.phases() == {
        "manifest": 0.1,
        "alloc": 0.3,
        "agent": 0.1,
        "transfer": 1.0,
        "verify": 0.25,
    }


def test_demo_groups_run_builtin_or_vllm_and_bind_each_rank_to_a_core() -> None:
    """`demo --pods-per-replica 2`: builtin or vLLM (up to the tiny Llama's 2 KV heads), never
    Triton; vLLM's ranks get a one-host binding list each group pod takes its entry of."""
    import click
    import pytest

    from weightlift.local.demo import _parallelism, _threads_bind

    assert _parallelism(1, "vLLM") is None
    assert _parallelism(2, "vLLM") == {"tensor": 2, "podsPerReplica": 2}
    for engine, pods in (("Triton", 2), ("vLLM", 4)):
        with pytest.raises(click.BadParameter):
            _parallelism(pods, engine)
    bind = _threads_bind({"tensor": 2, "podsPerReplica": 2})["VLLM_CPU_OMP_THREADS_BIND"]
    assert len(bind.split("|")) == 2
    assert _threads_bind(None) == {}
