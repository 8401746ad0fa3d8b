"""`weightlift bench p2p --pods-per-replica 2`: the 2-pod-per-replica row. Real `weightlift
worker` processes as the pods of two LeaderWorkerSet groups (LWS_WORKER_INDEX/LWS_GROUP_SIZE, a
hand-off file and a 127.x IP each, as on the process node) of a tensor=2 tp-blocks model, one
rank per pod. All four start together and wait in Standby (imports, program, hooks: not
counted); then the source group is handed storage and the target group, once the source serves,
rank-matched peers (pod i <- the source's pod i). Each pod's GB/s and load seconds come from its
own report; a group's time to Ready runs from its hand-off to its last pod Serving (the load
plus the group's torch.distributed join), the target's held against the source's storage load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from weightlift.api.worker import (
    GROUP_INDEX_ENV,
    GROUP_SIZE_ENV,
    PEER_TOKEN_ENV,
    PEERS_FILE_ENV,
    PeerCandidate,
    PeerHandoff,
    WorkerPlan,
)
from weightlift.local.models import make_demo
from weightlift.local.net import free_port
from weightlift.local.processnode import write_atomic

TOKEN = "bench-group-peer-token-0123456789"
# Loopback addresses of our own (all of 127/8 routes to lo), away from the process node's.
SUBNET = "127.36.{}.{}"
PODS = 2
JSON = dict[str, Any]


@dataclass
class GroupPod:
    name: str
    ip: str
    port: int
    index: int
    folder: Path
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(f"http://{self.address}/weightlift/v1/status", timeout=5).json())

    def hand(self, handoff: PeerHandoff) -> None:
        write_atomic(self.folder / "peers", {"peers.json": handoff.to_text()})

    def wait(self, phase: str, timeout: float) -> dict[str, Any]:
        deadline, last = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                last = self.status()
                if last.get("phase") in (phase, "Failed"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        if last.get("phase") != phase:
            log = (self.folder / "worker.log").read_text()[-2000:]
            raise RuntimeError(f"{self.name}: not {phase} ({last.get('message')})\n{log}")
        return last


def _start(model: Path, work: Path, name: str, ip: str, index: int) -> GroupPod:
    folder = work / name
    folder.mkdir(parents=True)
    write_atomic(folder / "peers", {"peers.json": ""})  # as the kubelet projects it, empty
    port = free_port(ip)
    plan = WorkerPlan.model_validate(
        {
            "deployment": "bench",
            "podName": name,
            "modelIdentity": "bench-group",
            "model": {"uri": f"file://{model}"},
            "modelDir": str(model),
            "servedModelName": "bench",
            "tensorParallel": PODS,
            "ranks": list(range(PODS)),
            "podsPerReplica": PODS,
            "device": "cpu",
            "host": ip,
            "runtime": {"port": port},
        }
    )
    (folder / "plan.json").write_text(plan.model_dump_json(by_alias=True, exclude_none=True))
    env = {
        **os.environ,
        "WEIGHTLIFT_BIND_HOST": ip,
        "POD_IP": ip,
        "POD_NAME": name,
        GROUP_INDEX_ENV: str(index),
        GROUP_SIZE_ENV: str(PODS),
        PEERS_FILE_ENV: str(folder / "peers" / "peers.json"),
        PEER_TOKEN_ENV: TOKEN,
        "UCX_MEM_MMAP_HOOK_MODE": "none",  # as the workers of bench p2p (see p2p.py)
    }
    argv = [sys.executable, "-m", "weightlift", "worker", "--plan", str(folder / "plan.json")]
    with (folder / "worker.log").open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    return GroupPod(name, ip, port, index, folder, proc)


def _ready(pods: list[GroupPod], handed: float, timeout: float) -> JSON:
    """The group's seconds from its hand-off to its last pod Serving, and each pod's load."""
    reports = [pod.wait("Serving", timeout) for pod in pods]
    done = max(r["timeline"]["serving"] for r in reports)
    rows = [
        {
            "pod": pod.name,
            "ranks": r["ranks"],
            "loadedFrom": r["loadedFrom"],
            "bytes": r["bytesLoaded"],
            "gbps": r.get("gbps"),
            "loadSeconds": r.get("loadSeconds"),
        }
        for pod, r in zip(pods, reports, strict=True)
    ]
    return {"readySeconds": done - handed, "pods": rows}


def run_group_row(size_mb: float, work: Path, timeout: float = 300.0) -> JSON:
    """Source group from storage, then a target group over P2P; see the module doc."""
    model = work / "model-tp2"
    made = make_demo(model, size_mb, tp=PODS, hook=False)
    names = [("src", 1), ("tgt", 2)]
    pods = [
        _start(model, work, f"{g}-{i}", SUBNET.format(n, i + 1), i)
        for g, n in names
        for i in range(PODS)
    ]
    source, target = pods[:PODS], pods[PODS:]
    try:
        for pod in pods:
            pod.wait("Standby", timeout)
        leader = f"{source[0].ip}:{free_port(source[0].ip)}"
        handed = time.time()
        for pod in source:
            pod.hand(PeerHandoff(storage=True, leader=leader))
        source_row = _ready(source, handed, timeout)
        leader = f"{target[0].ip}:{free_port(target[0].ip)}"
        handed = time.time()
        for pod, peer in zip(target, source, strict=True):
            pod.hand(
                PeerHandoff(
                    peers=[PeerCandidate(pod=peer.name, address=peer.address)], leader=leader
                )
            )
        target_row = _ready(target, handed, timeout)
    finally:
        for pod in pods:
            if pod.proc.poll() is None:
                pod.proc.send_signal(signal.SIGTERM)
        for pod in pods:
            try:
                pod.proc.wait(20)
            except subprocess.TimeoutExpired:
                pod.proc.kill()
    return {
        "podsPerReplica": PODS,
        "modelBytes": made.bytes_total,
        "source": source_row,
        "target": target_row,
        "targetOverSource": target_row["readySeconds"] / source_row["readySeconds"],
    }
