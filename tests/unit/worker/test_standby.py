"""A Target created before any source is Ready: it prepares (hooks, program, pull buffers),
waits in Standby with /infer closed, and loads what its hand-off file names, when it names it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.worker import make_plan, running_worker
from weightlift.api.worker import PEERS_FILE_ENV, PeerCandidate, PeerHandoff
from weightlift.local.models import DemoModel
from weightlift.local.processnode import write_atomic
from weightlift.worker.p2p import reserve
from weightlift.worker.standby import (
    apply_handoff,
    read_handoff,
    starts_in_standby,
    wait_for_handoff_blocking,
)


def _closed(url: str) -> None:
    c = httpx.Client(base_url=url, timeout=10)
    assert c.get("/v2/health/ready").status_code == 503
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    refused = c.post("/v2/models/demo/infer", json=body)
    assert refused.status_code == 503 and "Standby" in refused.text


def test_standby_then_peers_from_the_file(
    demo_tp1: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handoff = tmp_path / "peers"
    write_atomic(handoff, {"peers.json": ""})  # as the kubelet projects an empty annotation
    monkeypatch.setenv(PEERS_FILE_ENV, str(handoff / "peers.json"))
    hooks = {"library": "hooks/libinit.so"}
    source_plan = make_plan(demo_tp1.out, podName="demo-0", initHooks=hooks)
    target_plan = make_plan(demo_tp1.out, podName="demo-1", role="Target", initHooks=hooks)
    assert starts_in_standby(target_plan, handoff / "peers.json")
    assert not starts_in_standby(source_plan, handoff / "peers.json")
    with running_worker(target_plan) as target:
        st = target.wait_phase({"Standby", "Failed"})
        assert st["phase"] == "Standby", st
        assert st["hooksRun"] and "standby" in st["timeline"]
        _closed(target.url)
        with running_worker(source_plan) as source:
            assert source.wait_phase({"Serving", "Failed"})["phase"] == "Serving"
            time.sleep(0.3)
            assert target.wait_phase({"Standby"})["phase"] == "Standby", "nothing handed yet"
            peer = PeerCandidate(pod="demo-0", address=f"127.0.0.1:{source_plan.runtime.port}")
            write_atomic(handoff, {"peers.json": PeerHandoff(peers=[peer]).to_text()})
            st = target.wait_phase({"Serving", "Failed"})
            assert st["phase"] == "Serving", st
            assert st["loadedFrom"] == "peer:demo-0" and st["strategy"] == "p2p"
            # The transport UCX named for rank 0's READs (cma or tcp on one host).
            (said,) = st["transports"]
            assert said["rank"] == 0 and said["transport"].split("/")[0] in ("cma", "tcp"), said
            assert st["timeline"]["standby"] <= st["timeline"]["peers"] <= st["timeline"]["load"]
            assert httpx.get(target.url + "/v2/health/ready", timeout=5).status_code == 200


def test_storage_handed_loads_from_storage(
    demo_tp1: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handoff = tmp_path / "peers"
    write_atomic(handoff, {"peers.json": ""})
    monkeypatch.setenv(PEERS_FILE_ENV, str(handoff / "peers.json"))
    with running_worker(make_plan(demo_tp1.out, podName="demo-1", role="Target")) as target:
        assert target.wait_phase({"Standby", "Failed"})["phase"] == "Standby"
        write_atomic(handoff, {"peers.json": PeerHandoff(storage=True).to_text()})
        st = target.wait_phase({"Serving", "Failed"})
        assert st["phase"] == "Serving" and st["loadedFrom"] == "storage:file", st
        assert st["role"] == "Source"


def test_the_file_is_read_only_when_it_hands_something(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    assert read_handoff(path) is None  # not there (yet)
    for text in ("", "  ", "{}", "not json", '{"peers": []}'):
        path.write_text(text)
        assert read_handoff(path) is None, text
    path.write_text('{"storage": true}')
    assert read_handoff(path) == PeerHandoff(storage=True)


def test_blocking_wait_returns_what_is_handed_or_storage_at_its_bound(tmp_path: Path) -> None:
    """The vLLM ranks' wait (no event loop in their thread): the relayed hand-off, or storage
    once the bound passes with nothing handed."""
    path = tmp_path / "handoff.json"
    peer = PeerCandidate(pod="src", address="127.0.0.9:8000")
    writer = threading.Timer(0.3, lambda: path.write_text(PeerHandoff(peers=[peer]).to_text()))
    writer.start()
    try:
        assert wait_for_handoff_blocking(path, 30.0) == PeerHandoff(peers=[peer])
    finally:
        writer.cancel()
    started = time.monotonic()
    assert wait_for_handoff_blocking(tmp_path / "never.json", 0.3) == PeerHandoff(storage=True)
    assert time.monotonic() - started >= 0.3


def test_storage_releases_the_reserved_pull_buffers(demo_tp1: DemoModel) -> None:
    import torch

    reserve.reserve(torch.device("cpu"), 4096)
    plan = make_plan(demo_tp1.out, role="Target")
    assert apply_handoff(plan, PeerHandoff(storage=True)).peers == []
    assert reserve.take(torch.device("cpu"), 4096) is None
    reserved = reserve.reserve(torch.device("cpu"), 8192)
    assert reserve.take(torch.device("cpu"), 8192) is reserved
    assert reserve.take(torch.device("cpu"), 8192) is None, "one pull per buffer"


def test_ranks_of_one_size_on_one_device_each_take_their_own_buffer() -> None:
    import torch

    cpu = torch.device("cpu")
    first, second = reserve.reserve(cpu, 4096), reserve.reserve(cpu, 4096)
    taken = [reserve.take(cpu, 4096), reserve.take(cpu, 4096)]
    assert {id(t) for t in taken} == {id(first), id(second)}
    assert reserve.take(cpu, 4096) is None
