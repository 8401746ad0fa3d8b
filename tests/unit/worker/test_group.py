"""A pod of a multi-pod replica: its ranks and env checks, its hand-off, and the group's
collective inference equal to one process running every rank."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.support.worker import free_port, make_plan
from weightlift.api.model import Role
from weightlift.api.worker import (
    GROUP_INDEX_ENV,
    GROUP_SIZE_ENV,
    PEERS_FILE_ENV,
    PeerCandidate,
    PeerHandoff,
    WorkerPlan,
)
from weightlift.local.models import DemoModel
from weightlift.worker.engines.builtin.group import Group, GroupBroken, GroupRunner, Member
from weightlift.worker.engines.builtin.runtime import BindError, Pt2Runtime
from weightlift.worker.plan import GroupPlace, GroupRefused, group_place
from weightlift.worker.standby import HandoffRefused, apply_handoff, starts_in_standby, wait_limit
from weightlift.worker.weights.files import rank_files

ENV = {
    GROUP_INDEX_ENV: "1",
    GROUP_SIZE_ENV: "2",
    PEERS_FILE_ENV: "/etc/weightlift/peers/peers.json",
    "WEIGHTLIFT_BIND_HOST": "127.0.7.2",
}


def _group_plan(model_dir: Path, tp: int = 4, pods: int = 2, **extra: Any) -> WorkerPlan:
    return make_plan(model_dir, tp=tp, podsPerReplica=pods, **extra)


def test_a_pod_narrows_to_its_share_of_the_ranks(tmp_path: Path) -> None:
    plan, place = group_place(_group_plan(tmp_path), ENV)
    assert plan.ranks == [2, 3] and place == GroupPlace(index=1, size=2, pod_ip="127.0.7.2")
    plan, place = group_place(_group_plan(tmp_path), {**ENV, GROUP_INDEX_ENV: "0"})
    assert plan.ranks == [0, 1] and place is not None and place.leader
    assert plan.pod_name == "demo-0", "no POD_NAME: the assignment's"
    plan, _ = group_place(_group_plan(tmp_path), {**ENV, "POD_NAME": "md-abc123-0-1"})
    assert plan.pod_name == "md-abc123-0-1", "one template names every pod alike: its own name"
    single = make_plan(tmp_path, tp=2)
    assert group_place(single, ENV) == (single, None), "one pod per replica: nothing changes"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({GROUP_SIZE_ENV: "3"}, [f"{GROUP_SIZE_ENV}=3", "podsPerReplica is 2"]),
        ({GROUP_INDEX_ENV: ""}, [GROUP_INDEX_ENV, GROUP_SIZE_ENV]),
        ({GROUP_INDEX_ENV: "2"}, [f"{GROUP_INDEX_ENV}=2", "pod 2 of 2"]),
        ({PEERS_FILE_ENV: ""}, [PEERS_FILE_ENV, "hand-off"]),
    ],
)
def test_env_that_does_not_fit_the_plan_is_refused_for_good(
    tmp_path: Path, env: dict[str, str], says: list[str]
) -> None:
    with pytest.raises(GroupRefused) as err:
        group_place(_group_plan(tmp_path), {**ENV, **env})
    assert err.value.permanent
    for word in says:
        assert word in str(err.value)


def test_other_engines_and_pipeline_stages_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GroupRefused, match="builtin runtime or vLLM"):
        group_place(_group_plan(tmp_path, runtime={"engine": "Triton", "enginePort": 8001}), ENV)
    vllm, place = group_place(_group_plan(tmp_path, runtime={"engine": "vLLM"}), ENV)
    assert place is not None and vllm.ranks == [2, 3], "vLLM groups narrow like builtin ones"
    with pytest.raises(GroupRefused, match="pipeline 2"):
        group_place(_group_plan(tmp_path, pipelineParallel=2), ENV)


def test_a_group_pod_waits_for_its_role_and_leader(tmp_path: Path) -> None:
    handoff = Path(ENV[PEERS_FILE_ENV])
    plan = _group_plan(tmp_path, role="Source")
    assert starts_in_standby(plan, handoff), "whatever its assignment's role"
    assert wait_limit(plan) > 3600, "no storage of its own: storage alone names no leader"
    with pytest.raises(HandoffRefused, match="without its group's leader") as err:
        apply_handoff(plan, PeerHandoff(storage=True))
    assert err.value.permanent
    peer = PeerCandidate(pod="src-1", address="127.0.7.9:8000")
    pulled = apply_handoff(plan, PeerHandoff(peers=[peer], leader="127.0.7.1:29500"))
    assert pulled.role == Role.TARGET and pulled.peers == [peer]
    target = _group_plan(tmp_path, role="Target")
    stored = apply_handoff(target, PeerHandoff(storage=True, leader="127.0.7.1:29500"))
    assert stored.role == Role.SOURCE and stored.peers == []


def _runtime(demo: DemoModel, ranks: list[int]) -> Pt2Runtime:
    rt = Pt2Runtime.open(demo.out)
    tensors = {
        r: {k: v for p in rank_files(demo.out, r, 2) for k, v in load_file(p).items()}
        for r in ranks
    }
    rt.bind(tensors, ranks=ranks if ranks != [0, 1] else None)
    return rt


def test_a_pod_binds_only_its_ranks_of_a_tp_blocks_model(demo_tp2: DemoModel) -> None:
    rt = _runtime(demo_tp2, [1])
    assert rt.ranks == [1]
    with pytest.raises(BindError, match=r"needs ranks \[0\]"):
        Pt2Runtime.open(demo_tp2.out).bind({1: {}}, ranks=[0])


def test_the_group_computes_what_one_process_does(demo_tp2: DemoModel) -> None:
    """Two pods in threads (process groups are not torch's global one): the leader's inference
    across the group equals the single-process TP result, bit for bit."""
    whole = _runtime(demo_tp2, [0, 1])
    pods = [_runtime(demo_tp2, [0]), _runtime(demo_tp2, [1])]
    port = free_port()
    leader = f"127.0.0.1:{port}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(
                Group.join,
                GroupPlace(i, 2, "127.0.0.1"),
                leader,
                Member(i, f"pod-{i}", f"127.0.0.1:{free_port()}"),
                20.0,
                3.0,
            )
            for i in range(2)
        ]
        groups = [j.result(timeout=60) for j in joins]
    assert [m.pod for m in groups[1].members] == ["pod-0", "pod-1"]
    runners = [GroupRunner(g, rt).start() for g, rt in zip(groups, pods, strict=True)]
    try:
        x = np.random.default_rng(3).standard_normal((3, demo_tp2.d_model)).astype(np.float32)
        want = whole.infer({"INPUT0": x})["OUTPUT0"]
        for _ in range(2):  # the followers serve one request after another
            flat = runners[0].submit(pods[0].inputs_of({"INPUT0": x})).result(timeout=30)
            got = pods[0].outputs_of(flat)["OUTPUT0"]
            assert np.array_equal(got, want)
        alone = pods[0].infer({"INPUT0": x})["OUTPUT0"]
        assert not np.allclose(alone, want), "one pod's ranks alone are not the model"
    finally:
        runners[0].stop()
    # The leader went quiet (no heartbeat): the follower's wait times out and names the rank
    # gone (its front door does not answer either).
    with pytest.raises(GroupBroken, match=r"group rank 0 \(pod pod-0 at 127.0.0.1:\d+\) is gone"):
        runners[1].failed.result(timeout=30)
    with pytest.raises(GroupBroken):
        runners[1].submit([]).result(timeout=1)


def test_a_pod_downloads_only_its_own_ranks_files(
    demo_tp2: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf:// (s3:// chooses the same way): pod 1 of a 2-pod replica fetches rank 1's shard and
    the small files, into a node-cache entry of its own (a whole-model entry stays whole)."""
    from weightlift.local.hubserver import HubRepo, HubServer
    from weightlift.worker.storage.fetch import cache_key, materialize
    from weightlift.worker.weights.progress import LoadProgress

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    repo = HubRepo()
    repo.add_commit(demo_tp2.out)
    with HubServer({"acme/tp2": repo}) as hub:
        plan = make_plan(tmp_path / "dir", tp=2, podsPerReplica=2)
        plan = plan.model_copy(
            update={
                "model": plan.model.model_copy(
                    update={"uri": "hf://acme/tp2", "endpoint": hub.endpoint}
                )
            }
        )
        plan, _ = group_place(plan, ENV)
        progress = LoadProgress()
        fetched = materialize(plan, progress)
    got = sorted(p.name for p in Path(fetched.model_dir).glob("*.safetensors"))
    own = rank_files(demo_tp2.out, 1, 2)
    assert got == [p.name for p in own] and all(n.startswith("rank-1-of-2") for n in got), got
    assert (Path(fetched.model_dir) / "model.pt2").is_file()
    small = sum(
        p.stat().st_size
        for p in demo_tp2.out.rglob("*")
        if p.is_file() and p.suffix != ".safetensors"
    )
    assert progress.bytes_total == small + sum(p.stat().st_size for p in own)
    assert cache_key(plan) == f"{plan.model_identity}.ranks-1"


def test_a_storage_load_after_a_download_counts_the_pods_own_shard(
    demo_tp2: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group pod fetches no weights while it waits; handed storage, it downloads its own
    files, then loads them: its bytesLoaded is its shard, not download plus load."""
    from aiohttp import web

    from weightlift.local.hubserver import HubRepo, HubServer
    from weightlift.worker.engines.base import BringUp
    from weightlift.worker.engines.builtin.engine import BuiltinEngine
    from weightlift.worker.server import WorkerState
    from weightlift.worker.weights.files import shard_index
    from weightlift.worker.weights.progress import LoadProgress

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    repo = HubRepo()
    repo.add_commit(demo_tp2.out)
    with HubServer({"acme/tp2": repo}) as hub:
        plan = make_plan(tmp_path / "dir", tp=2, podsPerReplica=2)
        model = plan.model.model_copy(update={"uri": "hf://acme/tp2", "endpoint": hub.endpoint})
        plan, _ = group_place(plan.model_copy(update={"model": model}), ENV)
        engine = BuiltinEngine(plan)
        state = WorkerState.for_plan(plan)
        engine.ctx = BringUp(state=state, app=web.Application(), has_weights=False)
        progress = LoadProgress()
        strategy, tensors = engine._load_rank(1, progress)
    want = shard_index(demo_tp2.out, 1, 2).data_bytes
    assert strategy in ("preload", "direct") and tensors
    assert progress.bytes_loaded == progress.bytes_total == want


def test_a_follower_learns_that_its_leader_failed_for_good() -> None:
    """A follower whose join fails asks the leader's front door: a permanent failure there
    makes the follower's own permanent (no exit, no group crash loop); anything else does not."""
    import http.server
    import json as json_
    import threading

    from weightlift.worker.engines.builtin.group import leader_failure

    answers = [{"phase": "Failed", "permanentFailure": True, "message": "libinit.so: no symbol"}]

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json_.dumps(answers[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert leader_failure("127.0.0.1:29500", port) == "libinit.so: no symbol"
        answers[0] = {"phase": "Failed", "permanentFailure": False, "message": "OOM"}
        assert leader_failure("127.0.0.1:29500", port) is None
        answers[0] = {"phase": "Loading"}
        assert leader_failure("127.0.0.1:29500", port) is None
    finally:
        server.shutdown()
        server.server_close()
    assert leader_failure("127.0.0.1:29500", port) is None  # nobody answers


def test_a_pod_held_at_the_group_join_joins_once_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos bench's GROUP_JOIN hold (local nodes only): a group pod with its weights bound
    says it waits at the gate and does not join its group until the harness lets it go."""
    import asyncio
    from types import SimpleNamespace

    from weightlift.worker.engines.builtin import engine as builtin
    from weightlift.worker.p2p import faultgate

    gate = tmp_path / "gate"
    monkeypatch.setenv(faultgate.GATE_DIR_ENV, str(gate))
    monkeypatch.setenv(faultgate.PROCESS_NODE_ENV, "test-node")
    joined: list[str] = []

    def join(place: GroupPlace, leader: str, me: Member) -> object:
        joined.append(me.pod)
        return SimpleNamespace()

    monkeypatch.setattr(builtin.Group, "join", join)
    monkeypatch.setattr(
        builtin, "GroupRunner", lambda group, runtime: SimpleNamespace(start=lambda: group)
    )
    plan, place = group_place(_group_plan(tmp_path), {**ENV, "POD_NAME": "md-abc123-0-0-1"})
    engine = builtin.BuiltinEngine(plan)
    engine.runtime, engine.leader = object(), "127.0.7.1:29500"  # type: ignore[assignment]
    ctx = SimpleNamespace(group=place, stamp=lambda step: None)
    faultgate.hold_at(gate, "md", faultgate.GROUP_JOIN)

    async def scenario() -> None:
        task = asyncio.ensure_future(engine.join_group(ctx))  # type: ignore[arg-type]
        for _ in range(500):  # the pod says it waits at the gate (else joined at once)
            if faultgate.waiting_at(gate, "md", faultgate.GROUP_JOIN) or task.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # held: a gate, not a delay
        assert not joined and not task.done()
        faultgate.release_at(gate, "md", faultgate.GROUP_JOIN)
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert joined == ["md-abc123-0-0-1"]
