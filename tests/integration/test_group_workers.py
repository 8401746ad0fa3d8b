"""Multi-pod replicas, worker side, no Kubernetes: `weightlift worker` processes as the pods of
two LeaderWorkerSet groups (LWS_WORKER_INDEX / LWS_GROUP_SIZE, a hand-off file each, a 127.x
IP each as on the process node) of a tensor=2 tp-blocks model, one rank per pod.

The source group is handed storage, the target group peers (pod i gets the source group's pod
i: rank-matched) and each group its leader; each pod loads only its own shard, both groups
answer inference across their pods with the single-process result, and killing a group's
follower breaks that group (its leader fails fast, names the rank and exits) but not the other.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from tests.support.worker import make_plan
from weightlift.api.worker import (
    GROUP_INDEX_ENV,
    GROUP_SIZE_ENV,
    PEER_TOKEN_ENV,
    PEERS_FILE_ENV,
    PeerCandidate,
    PeerHandoff,
)
from weightlift.local.models import DemoModel, make_demo
from weightlift.local.net import free_port
from weightlift.local.processnode import write_atomic
from weightlift.worker.engines.builtin.runtime import Pt2Runtime
from weightlift.worker.weights.files import rank_files

REPO = Path(__file__).resolve().parents[2]
TOKEN = "group-test-peer-token-0123456789"
# Addresses of our own on loopback (Linux routes all of 127/8 to lo), away from the process
# node's 127.0.x.y pods.
SUBNET = "127.35.{}.{}"


@dataclass
class Pod:
    name: str
    ip: str
    port: int
    index: int
    handoff: Path
    proc: subprocess.Popen[bytes]
    folder: Path

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/weightlift/v1/status", timeout=5).json())

    def wait_phase(self, phases: set[str], timeout: float = 90) -> dict[str, Any]:
        deadline, last = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.log()}")
            try:
                last = self.status()
                if last.get("phase") in phases:
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: never {phases}; last {json.dumps(last)}\n{self.log()}")

    def hand(self, handoff: PeerHandoff) -> None:
        write_atomic(self.handoff.parent, {"peers.json": handoff.to_text()})

    def log(self) -> str:
        return (self.folder / "worker.log").read_text()[-3000:]


def _start(
    demo: DemoModel,
    tmp: Path,
    name: str,
    ip: str,
    index: int,
    role: str,
    plan_extra: dict[str, Any] | None = None,
    **env: str,
) -> Pod:
    folder = tmp / name
    folder.mkdir()
    handoff = folder / "peers"
    write_atomic(handoff, {"peers.json": ""})  # as the kubelet projects an empty annotation
    port = free_port(ip)
    fields: dict[str, Any] = {
        "podName": name,
        "role": role,
        "podsPerReplica": 2,
        "initHooks": {"library": "hooks/libinit.so"},
        "runtime": {"port": port},
    }
    plan = make_plan(demo.out, tp=2, **{**fields, **(plan_extra or {})})
    (folder / "plan.json").write_text(plan.model_dump_json(by_alias=True, exclude_none=True))
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "WEIGHTLIFT_BIND_HOST": ip,
        "POD_IP": ip,
        GROUP_INDEX_ENV: str(index),
        GROUP_SIZE_ENV: "2",
        PEERS_FILE_ENV: str(handoff / "peers.json"),
        PEER_TOKEN_ENV: TOKEN,
        "WEIGHTLIFT_FAIL_LINGER_SECONDS": "4",
        "WEIGHTLIFT_TERMINATION_LOG": str(folder / "termination-log"),
        "WEIGHTLIFT_HOOK_LOG": str(folder / "hooks.log"),
        **env,
    }
    with (folder / "worker.log").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightlift", "worker", "--plan", str(folder / "plan.json")],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=folder,
        )
    return Pod(name, ip, port, index, handoff / "peers.json", proc, folder)


def _stop(pods: list[Pod]) -> None:
    for pod in pods:
        if pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
    for pod in pods:
        try:
            pod.proc.wait(20)
        except subprocess.TimeoutExpired:
            pod.proc.kill()
            pod.proc.wait()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoModel:
    return make_demo(tmp_path_factory.mktemp("group-demo"), size_mb=3, tp=2, hook=True, seed=5)


@pytest.fixture(scope="module")
def groups(demo: DemoModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Pod]]:
    """s-0, s-1 (a source group) and t-0, t-1 (a target group), all Serving. Their assignments'
    roles are the wrong way round on purpose: a group pod's role is its hand-off's."""
    tmp = tmp_path_factory.mktemp("groups")
    pods = [
        _start(demo, tmp, f"{g}-{i}", SUBNET.format(n, i + 1), i, role)
        for n, (g, role) in enumerate([("s", "Target"), ("t", "Source")], start=1)
        for i in range(2)
    ]
    try:
        for pod in pods:
            st = pod.wait_phase({"Standby", "Failed"})
            assert st["phase"] == "Standby", st
        s0, s1, t0, t1 = pods
        leader = f"{s0.ip}:{free_port(s0.ip)}"
        for pod in (s0, s1):
            pod.hand(PeerHandoff(storage=True, leader=leader))
        for pod in (s0, s1):
            st = pod.wait_phase({"Serving", "Failed"})
            assert st["phase"] == "Serving", st
            _wait_published(pod)
        leader = f"{t0.ip}:{free_port(t0.ip)}"
        for pod, source in ((t0, s0), (t1, s1)):
            peer = PeerCandidate(pod=source.name, address=source.address)
            pod.hand(PeerHandoff(peers=[peer], leader=leader))
        for pod in (t0, t1):
            st = pod.wait_phase({"Serving", "Failed"})
            assert st["phase"] == "Serving", st
        yield pods
    finally:
        _stop(pods)


def _wait_published(pod: Pod, timeout: float = 30) -> dict[str, Any]:
    """The pod's P2P source health once its publisher is up (after Serving)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(
            pod.url + "/weightlift/v1/p2p/health",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return dict(r.json())
        time.sleep(0.1)


def shard_bytes(demo: DemoModel, rank: int) -> int:
    """Tensor bytes of one rank's files, read from their safetensors headers."""
    total = 0
    for path in rank_files(demo.out, rank, 2):
        raw = Path(path).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        total += sum(
            e - b for k, v in header.items() if k != "__metadata__" for b, e in [v["data_offsets"]]
        )
    return total


def _request(demo: DemoModel) -> tuple[dict[str, Any], np.ndarray]:
    probe = json.loads((demo.out / "probe.json").read_text())
    item = probe["request"]["inputs"][0]
    x = np.array(item["data"], dtype=np.float32).reshape(item["shape"])
    return probe["request"], x


def _single_process(demo: DemoModel, x: np.ndarray) -> np.ndarray:
    rt = Pt2Runtime.open(demo.out)
    rt.bind(
        {
            r: {k: v for p in rank_files(demo.out, r, 2) for k, v in load_file(p).items()}
            for r in range(2)
        }
    )
    return rt.infer({"INPUT0": x})["OUTPUT0"]


def _infer(pod: Pod, request: dict[str, Any]) -> httpx.Response:
    return httpx.post(pod.url + "/v2/models/demo/infer", json=request, timeout=30)


def test_each_pod_loads_only_its_own_shard(groups: list[Pod], demo: DemoModel) -> None:
    s0, s1, t0, t1 = groups
    assert shard_bytes(demo, 0) > 0 and shard_bytes(demo, 0) + shard_bytes(demo, 1) == (
        demo.bytes_total
    )
    for pod in groups:
        st = pod.status()
        want = shard_bytes(demo, pod.index)
        assert st["ranks"] == [pod.index], st
        assert st["bytesLoaded"] == st["bytesTotal"] == want, (pod.name, st)
        # The init hook ran once, on the pod's own device 0 (not the global rank).
        assert [h["deviceIndex"] for h in st["hooks"]] == [0] and st["hooks"][0]["ok"], st
        lines = (pod.folder / "hooks.log").read_text().split()
        assert lines[0] == "init" and lines[2] == "0", lines
        assert "group" in st["timeline"] and st["timeline"]["group"] <= st["timeline"]["serving"]
    for pod in (s0, s1):
        st = pod.status()
        assert st["role"] == "Source" and st["loadedFrom"] == "storage:file", st
        assert _wait_published(pod)["ranks"] == [pod.index], "a pod publishes its own rank"
    for pod, source in ((t0, s0), (t1, s1)):
        st = pod.status()
        assert st["role"] == "Target" and st["strategy"] == "p2p", st
        assert st["loadedFrom"] == f"peer:{source.name}", "rank-matched: the same index"


def test_both_groups_answer_as_one_process_does(groups: list[Pod], demo: DemoModel) -> None:
    s0, s1, t0, t1 = groups
    request, x = _request(demo)
    want = _single_process(demo, x)
    for leader in (s0, t0):
        r = _infer(leader, request)
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        got = np.array(out["data"], dtype=np.float32).reshape(out["shape"])
        assert np.array_equal(got, want), (leader.name, float(np.abs(got - want).max()))
    for follower, leader in ((s1, s0), (t1, t0)):
        assert httpx.get(follower.url + "/v2/health/ready", timeout=5).status_code == 200
        r = _infer(follower, request)
        assert r.status_code == 421, r.text
        assert "send inference to the group leader" in r.text, r.text
        assert f"pod {leader.name} at {leader.address}" in r.text, r.text


def test_a_dead_follower_breaks_its_group_only(groups: list[Pod], demo: DemoModel) -> None:
    s0, _s1, t0, t1 = groups
    request, _ = _request(demo)
    t1.proc.kill()
    t1.proc.wait()
    killed = time.monotonic()
    answer = None
    while time.monotonic() - killed < 15:
        r = _infer(t0, request)
        if r.status_code != 200:
            answer = r
            break
        time.sleep(0.2)
    assert answer is not None, "the leader still answered 15 s after its follower died"
    assert answer.status_code == 503, answer.text
    assert "group rank 1" in answer.text and f"pod {t1.name} at {t1.address}" in answer.text
    st = t0.status()
    assert st["phase"] == "Failed" and not st["permanentFailure"], st
    assert f"group rank 1 (pod {t1.name} at {t1.address}) is gone" in st["message"], st
    assert t0.proc.wait(30) == 1, "a broken group's pod exits non-zero (its group is recreated)"
    assert "group rank 1" in (t0.folder / "termination-log").read_text()
    # The other group is untouched.
    r = _infer(s0, request)
    assert r.status_code == 200, r.text


def test_a_permanent_failure_keeps_reporting_instead_of_exiting(
    demo: DemoModel, tmp_path: Path
) -> None:
    """restartPolicy Always: a group pod that can never run says why and stays up."""
    bad = {GROUP_SIZE_ENV: "3", "WEIGHTLIFT_FAIL_LINGER_SECONDS": "1"}
    pod = _start(demo, tmp_path, "bad-0", SUBNET.format(9, 1), 0, "Source", **bad)
    started = [pod]
    try:
        st = pod.wait_phase({"Failed"}, timeout=60)
        assert st["permanentFailure"], st
        assert f"{GROUP_SIZE_ENV}=3" in st["message"] and "podsPerReplica is 2" in st["message"]
        # The moment it would have exited, as an event: a pod of no group, started only now,
        # that fails (its hook library is missing) and exits once the same linger has run out.
        control = _start(
            demo,
            tmp_path,
            "alone-0",
            SUBNET.format(9, 2),
            0,
            "Source",
            plan_extra={"podsPerReplica": 1, "initHooks": {"library": "hooks/missing.so"}},
            **bad,
        )
        started.append(control)
        assert control.proc.wait(60) == 1, f"the control did not fail and exit: {control.log()}"
        assert "missing.so" in (control.folder / "termination-log").read_text()
        assert pod.proc.poll() is None, "a permanent failure in a group must not exit"
        assert pod.status()["phase"] == "Failed"
    finally:
        _stop(started)
