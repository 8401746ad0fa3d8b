"""Triton replicas on the real control plane: the operator plans a source and a P2P target, each
worker starts the real tritonserver (2.51, nvidia-pytriton's) whose Python-backend model runs
vLLM with weightlift's load format, and READY means Triton's own generate extension answered
the greedy text transformers generated for the same weights. One tritonserver pair for the
module (each start is 20-60 s of vLLM imports on 2 cores), then a third replica whose sources
die mid-pull, then a worker killed alone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http

from tests.support.cluster import wait_for
from tests.support.e2e import alive, fault_gate, pids_of, wait_gone
from tests.support.triton import require_triton_home
from tests.support.vllm import (
    ENGINE_ARGS,
    ENGINE_ENV,
    READY_TIMEOUT,
    TEST_TIMEOUT,
    require_vllm_python,
    tiny_llm,
)
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, add_hook_library, model_deployment
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
NAME = "triton"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JSON, Path]:
    python = require_vllm_python()
    home = require_triton_home(python)
    out = tmp_path_factory.mktemp("e2e-triton-llm")
    probe = tiny_llm(python, out)
    add_hook_library(out)
    return out, probe, home


@pytest.fixture(scope="module")
def pair(stack: LocalStack, llm: tuple[Path, JSON, Path]) -> Iterator[Observer]:
    """Two Triton replicas (a storage source, a P2P target), Ready; deleted after the module."""
    model, probe, _ = llm
    manifest = model_deployment(
        NAME,
        model,
        probe=probe,
        replicas=2,
        engine="Triton",
        engine_args=ENGINE_ARGS,
        env=ENGINE_ENV,  # the stack passes WEIGHTLIFT_TRITON_HOME (tests/support/triton.py)
        hook_library="hooks/libinit.so",
    )
    obs = Observer(stack, NAME)
    stack.apply(manifest)
    try:
        obs.wait_ready(2 * READY_TIMEOUT)
        yield obs
    finally:
        pids = pids_of(stack, NAME)
        if stack.get_md(NAME) is not None:
            stack.delete_md(NAME)
        wait_gone(stack, NAME, sorted(pids))


def _generate_with_tritonclient(endpoint: str, completion: JSON) -> str:
    client = triton_http.InferenceServerClient(endpoint.removeprefix("http://"))
    try:
        text = triton_http.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([completion["prompt"].encode()], dtype=np.object_))
        result = client.infer(
            NAME,
            [text],
            parameters={"max_tokens": completion["maxTokens"], "temperature": 0},
        )
        out = result.as_numpy("text_output")
        assert out is not None
        return bytes(out.reshape(-1)[0]).decode()
    finally:
        client.close()


@pytest.mark.timeout(TEST_TIMEOUT)
def test_triton_source_from_storage_target_by_p2p_same_greedy_text(
    pair: Observer, llm: tuple[Path, JSON, Path], hook_log: Path
) -> None:
    model, probe, _ = llm
    rows = pair.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] and r["probe"]["passed"] for r in rows), rows
    source = next(r for r in rows if r["loadedFrom"] == "storage:hostpath")
    target = next(r for r in rows if r["name"] != source["name"])
    assert source["role"] == "Source" and target["role"] == "Target", rows
    assert target["loadedFrom"] == f"peer:{source['name']}", target
    assert target["bytesLoaded"] == target["bytesTotal"] == source["bytesTotal"] > 0
    # Triton's own ports, as the pod spec declares them, in the ModelDeployment's status.
    assert all(r["enginePorts"] == {"http": 8001, "grpc": 8003, "metrics": 8002} for r in rows)
    summary = pair.summary()["replicas"]
    assert all(r["tritonEndpoint"] and r["modelName"] == NAME for r in summary), summary
    # tritonclient against each replica's own tritonserver: transformers' greedy text twice.
    texts = [_generate_with_tritonclient(r["tritonEndpoint"], probe["completion"]) for r in summary]
    assert texts == [probe["completion"]["expectedText"]] * 2, texts
    for r in summary:
        # The worker's front door forwards Triton's generate and appends Triton's metrics.
        body = {"text_input": probe["completion"]["prompt"], "parameters": {"max_tokens": 2}}
        doc = httpx.post(f"{r['endpoint']}/v2/models/{NAME}/generate", json=body, timeout=60)
        assert doc.status_code == 200 and isinstance(doc.json()["text_output"], str), doc.text
        metrics = httpx.get(f"{r['endpoint']}/metrics", timeout=10).text
        assert "weightlift_ready 1.0" in metrics and "nv_inference_request_success" in metrics
        status = httpx.get(f"{r['endpoint']}/weightlift/v1/status", timeout=10).json()
        assert set(status["enginePorts"]) == {"http", "grpc", "metrics"}, status
    # Standby: the target's tritonserver started with its pod; the model's vLLM ran the hooks
    # and its weight step waited for the hand-off (peers) inside Triton's model load.
    timeline = _worker_status(pair, target["name"]).get("timeline", {})
    assert {"engine", "hooks", "standby", "peers"} <= set(timeline), timeline
    # Hooks and the hand-off both come before the load; which of the two comes first is the
    # machine's pace (the source is not held here: on a loaded machine it is Ready first).
    assert max(timeline["hooks"], timeline["peers"]) < timeline["load"], timeline
    # The init hook ran in each replica's Triton stub (vLLM rank 0), before its weights.
    inits = [ln.split() for ln in hook_log.read_text().splitlines() if ln.startswith("init ")]
    mine = [ln for ln in inits if Path(ln[1]).resolve() == model.resolve() and ln[2] == "0"]
    assert len(mine) >= 2, inits


def _worker_status(obs: Observer, pod: str) -> JSON:
    """The worker's own report (timeline, message) through its pod endpoint; {} until it has
    one."""
    row = next((r for r in obs.summary()["replicas"] if r["name"] == pod), None)
    if row is None or not row["endpoint"]:
        return {}
    try:
        doc: JSON = httpx.get(row["endpoint"] + "/weightlift/v1/status", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return doc


@pytest.mark.timeout(TEST_TIMEOUT)
def test_sources_killed_mid_pull_leave_the_target_to_storage(
    pair: Observer, stack: LocalStack, llm: tuple[Path, JSON, Path]
) -> None:
    """A third replica starts as a Target; the process node's fault gate holds its pull once
    the first READ from a source has landed (worker/p2p/faultgate.py: the same pull code runs in
    its Triton stub's vLLM rank, after the init hook), and both Ready replicas die (SIGKILL)
    while it holds: let go, the pull meets dead peers, the target falls back to storage and
    answers correctly, and nothing of the killed pods (worker, tritonserver, stub) is left."""
    _, probe, _ = llm
    before = {p["metadata"]["name"] for p in pair.pods}
    groups = pids_of(stack, NAME)  # each pod's worker leads its process group
    assert len(groups) == 2, groups
    members = [p for p in _procs() if _pgid(p) in set(groups)]
    gate = fault_gate(stack)
    faultgate.arm(gate, NAME)
    try:
        stack.patch_md(
            NAME,
            {"spec": {"replicas": 3, "loading": {"peerToPeer": {"transferTimeoutSeconds": 20}}}},
        )
        held = wait_for(lambda: faultgate.holding(gate, NAME), 2 * READY_TIMEOUT, "a held pull")
        assert held is not None and held.in_flight, held
        assert held.peer in before and held.pod not in before, (held, before)
        new = held.pod
        for pid in groups:
            os.killpg(pid, signal.SIGKILL)
    finally:
        faultgate.disarm(gate, NAME)  # the pull goes on against dead peers
    pair.wait(
        lambda o: any(r["name"] == new and r.get("ready") for r in o.replica_statuses()),
        2 * READY_TIMEOUT,
        "the target Ready after losing its sources",
    )
    target = next(r for r in pair.replica_statuses() if r["name"] == new)
    assert target["loadedFrom"] == "storage:hostpath", target
    assert target["bytesLoaded"] == target["bytesTotal"] > 0 and target["hooksRun"], target
    # Either the pull met the dead peers and fell back (still a Target), or the operator saw
    # every peer it had handed gone first and handed the target storage itself, relabelled
    # Source (planning's SourceGone): no weights from a dead peer either way.
    assert target["role"] in ("Target", "Source"), target
    if target["role"] == "Target":
        assert "peer-to-peer failed" in _worker_status(pair, new)["message"]
    row = next(r for r in pair.summary()["replicas"] if r["name"] == new)
    text = _generate_with_tritonclient(row["tritonEndpoint"], probe["completion"])
    assert text == probe["completion"]["expectedText"]
    assert len(members) >= 6, members  # 2 x (worker, tritonserver, stub)
    assert not any(alive(p) for p in members), [p for p in members if alive(p)]


def test_a_killed_worker_takes_its_tritonserver_and_stub_along(
    pair: Observer, stack: LocalStack
) -> None:
    """Last in the module (it breaks the pair): SIGKILL one worker, nothing of its tritonserver
    stays. The worker arms PR_SET_PDEATHSIG for tritonserver; Triton's stub watches its parent."""
    servers = {_parent(p): p for p in _procs_named("tritonserver")}
    # A Ready replica's: its stub has loaded the model (and watches tritonserver); the pods the
    # operator recreated after the previous test may still be starting theirs.
    ready = {r["name"] for r in pair.replica_statuses() if r.get("ready")}
    by_pod = {key.split("/")[1]: pids for key, pids in stack.node.pids().items()}
    workers = [w for name in sorted(ready) for w in by_pod.get(name, []) if w in servers]
    assert workers, (ready, by_pod, servers)
    victim = workers[-1]
    server = servers[victim]
    stubs = [p for p in _procs_named("triton_python_b") if _parent(p) == server]
    assert stubs, "tritonserver runs its Python backend stub"
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(alive(p) for p in [server, *stubs]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in [server, *stubs]), "tritonserver outlived its worker"


def _procs() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _procs_named(comm: str) -> list[int]:
    found = []
    for pid in _procs():
        try:
            if (Path("/proc") / str(pid) / "comm").read_text().strip() == comm:
                found.append(pid)
        except OSError:
            continue
    return found


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def _parent(pid: int) -> int:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])
