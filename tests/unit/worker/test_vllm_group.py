"""A vLLM group pod's command and env (engines/vllm/group.py): node `index` of `size`, the
leader's address from the hand-off, the mp executor, a thread binding of its own ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.worker import make_plan
from weightlift.worker.engines.vllm.engine import group_command
from weightlift.worker.engines.vllm.group import (
    GroupAddressError,
    group_env,
    split_leader,
    without_executor,
)
from weightlift.worker.engines.vllm.serve import CLI_SERVE
from weightlift.worker.plan import GroupPlace

LEADER = GroupPlace(index=0, size=2, pod_ip="127.0.7.1")
FOLLOWER = GroupPlace(index=1, size=2, pod_ip="127.0.7.2")


def _command(tmp_path: Path, place: GroupPlace) -> list[str]:
    plan = make_plan(
        tmp_path,
        tp=2,
        podsPerReplica=2,
        runtime={"engine": "vLLM", "engineArgs": ["--distributed-executor-backend", "uni"]},
    )
    return group_command(plan, tmp_path / "p.json", tmp_path, place, "127.0.7.1:29500")


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_leader_serves_and_the_others_run_headless_through_vllm_serve(
    tmp_path: Path,
) -> None:
    lead, follow = _command(tmp_path, LEADER), _command(tmp_path, FOLLOWER)
    for cmd, rank in ((lead, "0"), (follow, "1")):
        # `vllm serve`: the api_server module would ignore --headless.
        assert cmd[cmd.index("weightlift.worker.engines.vllm.serve") + 1] == CLI_SERVE
        assert _flag(cmd, "--node-rank") == rank and _flag(cmd, "--nnodes") == "2"
        assert _flag(cmd, "--master-addr") == "127.0.7.1"
        assert _flag(cmd, "--master-port") == "29500"
        # The user's `uni` is gone: only mp spans nodes.
        assert cmd.count("--distributed-executor-backend") == 1
        assert _flag(cmd, "--distributed-executor-backend") == "mp"
    assert "--headless" in follow and "--port" not in follow
    assert "--headless" not in lead and "--port" in lead


def test_env_binds_each_pod_to_its_own_ranks_cores_and_address() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    follower = group_env(env, FOLLOWER, [1], 2)
    assert follower["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert follower["VLLM_HOST_IP"] == "127.0.7.2"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in follower
    assert group_env(env, LEADER, [0], 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    # A binding not listing every rank is the user's own choice for each pod.
    assert (
        group_env({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, LEADER, [0], 2)[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "nobind"
    )


def test_leader_addresses() -> None:
    assert split_leader("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert split_leader("[fd00::5]:29500") == ("fd00::5", 29500)
    for bad in ("10.0.0.5", ":29500", "host:port"):
        with pytest.raises(GroupAddressError, match="host:port"):
            split_leader(bad)
    assert without_executor(["--a", "--distributed-executor-backend=uni", "--b"]) == [
        "--a",
        "--b",
    ]


def test_a_group_leaders_store_listens_on_its_pod_ip_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process node: every pod on the host's network, each with its own 127.x IP. Another
    group's leader already listens on the hand-off's port at its own IP; this leader's store
    still listens, on its IP (torch's own would take the port on every address and fail)."""
    import datetime
    import importlib

    from weightlift.local.net import free_port
    from weightlift.worker.engines.vllm.store_bind import (
        STORE_HOST_ENV,
        bind_store_to_pod_ip,
        listening_socket,
    )

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setattr(rendezvous, "_create_c10d_store", rendezvous._create_c10d_store)
    port, wait = free_port(), datetime.timedelta(seconds=5)
    with listening_socket("127.0.9.2", port):  # the other group's leader
        monkeypatch.setenv(STORE_HOST_ENV, "127.0.9.1")
        bind_store_to_pod_ip()
        store = rendezvous._create_c10d_store("127.0.9.1", port, 0, 1, wait)
        store.set("who", "leader")
        assert store.get("who") == b"leader"
