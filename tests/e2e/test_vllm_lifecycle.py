"""vLLM replicas on the real control plane: the operator plans a source and a P2P target, the
workers run the real vLLM CPU build with weightlift's load format, and READY means a greedy
completion matched the text transformers generated for the same weights."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.e2e import alive, fault_gate, held_source, pids_of
from tests.support.vllm import (
    ENGINE_ARGS,
    ENGINE_ENV,
    READY_TIMEOUT,
    TEST_TIMEOUT,
    require_vllm_python,
    tiny_llm,
)
from weightlift.local.observe import Observer, complete
from weightlift.local.stack import LocalStack, add_hook_library
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JSON]:
    python = require_vllm_python()
    out = tmp_path_factory.mktemp("e2e-llm")
    return out, tiny_llm(python, out)


def _deploy(
    deployments: Deploy,
    name: str,
    llm: tuple[Path, JSON],
    replicas: int,
    hook_library: str | None = None,
    **env: str,
) -> Observer:
    model, probe = llm
    return deployments(
        name,
        model,
        probe,
        replicas=replicas,
        engine="vLLM",
        engine_args=ENGINE_ARGS,
        env={**ENGINE_ENV, **env},
        hook_library=hook_library,
    )


def _texts(obs: Observer, probe: JSON) -> list[str]:
    return [
        complete(r["openaiEndpoint"], r["servedModelName"], probe["completion"])
        for r in obs.summary()["replicas"]
    ]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_vllm_source_from_storage_target_by_p2p_both_answer(
    stack: LocalStack, deployments: Deploy, llm: tuple[Path, JSON]
) -> None:
    """Standby: both pods start at once; the source waits at the fault gate before its load
    (alive, answering its probes) until the target's vLLM has built its model and waits at its
    weight step in phase Standby, never Ready; then the source loads from storage, the operator
    hands it to the target, which pulls."""
    _, probe = llm
    with held_source(stack, "vllm") as held:
        obs = _deploy(deployments, "vllm", llm, replicas=2)
        source_pod = held.pod()
        obs.wait(
            lambda o: _replica(o, 1).get("phase") == "Standby",
            2 * READY_TIMEOUT,
            "the target's vLLM waiting in Standby",
        )
        waiting = _replica(obs, 1)
        assert not waiting.get("ready"), waiting
        worker = _worker_status(obs, waiting["name"])
        # vLLM started and reached its weight step (model built, hooks run) before any peer.
        assert {"engine", "hooks", "standby"} <= set(worker.get("timeline", {})), worker
        assert "peers" not in worker["timeline"], worker
        assert _replica(obs, 0).get("name") == source_pod and not _replica(obs, 0).get("ready")
        blocked = httpx.get(f"{obs.summary()['replicas'][1]['endpoint']}/v1/models", timeout=10)
        assert blocked.status_code != 200, blocked.text  # the worker's /v1: closed until Ready
    obs.wait_ready(2 * READY_TIMEOUT)
    rows = obs.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] and r["probe"]["passed"] for r in rows), rows
    source = next(r for r in rows if r["loadedFrom"] == "storage:hostpath")
    target = next(r for r in rows if r["name"] != source["name"])
    assert source["role"] == "Source" and target["role"] == "Target", rows
    assert target["loadedFrom"] == f"peer:{source['name']}", target
    assert target["bytesLoaded"] == target["bytesTotal"] == source["bytesTotal"] > 0
    # Both OpenAI endpoints give transformers' greedy text for the probe's prompt.
    assert _texts(obs, probe) == [probe["completion"]["expectedText"]] * 2
    sources = {s["pod"] for s in obs.status().get("sources", [])}
    assert sources == {source["name"], target["name"]}, obs.status().get("sources")
    times = {r["name"]: r for r in obs.summary()["replicas"]}
    assert times[target["name"]]["standbyAt"] < times[source["name"]]["readyAt"], times
    # The worker's /metrics re-exports vLLM's series, each labelled with the replica.
    metrics = httpx.get(times[target["name"]]["endpoint"] + "/metrics", timeout=10).text
    running = [
        s.labels
        for family in text_string_to_metric_families(metrics)
        if family.name == "vllm:num_requests_running"
        for s in family.samples
    ]
    assert running and all(
        (labels["deployment"], labels["replica"]) == (obs.name, str(target.get("replica", 0)))
        for labels in running
    ), running


def _replica(obs: Observer, replica: int) -> JSON:
    return next((r for r in obs.replica_statuses() if r.get("replica") == replica), {})


def _worker_status(obs: Observer, pod: str) -> JSON:
    """The worker's own report (timeline, message) through its pod endpoint."""
    row = next((r for r in obs.summary()["replicas"] if r["name"] == pod), None)
    if row is None:  # the operator has not listed the pod in status yet
        return {}
    if not row["endpoint"]:
        return {}
    try:
        doc: JSON = httpx.get(row["endpoint"] + "/weightlift/v1/status", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return doc


@pytest.mark.timeout(TEST_TIMEOUT)
def test_vllm_source_dies_while_target_pulls_target_falls_back_to_storage(
    stack: LocalStack, deployments: Deploy, llm: tuple[Path, JSON], hook_log: Path
) -> None:
    """The source is killed while the target's vLLM pulls from it: the fault gate holds the
    pull once its first READ landed (worker/p2p/faultgate.py, in the vLLM rank), the source
    dies, the pull goes on against nothing and the target falls back to storage and answers
    correctly. Also: the init hook runs in each replica's vLLM rank before its weights, and the
    status says where the seconds went."""
    model, probe = llm
    add_hook_library(model)
    obs = _deploy(deployments, "vllmkill", llm, replicas=1, hook_library="hooks/libinit.so")
    obs.wait_ready(READY_TIMEOUT)
    source = obs.replica_statuses()[0]
    assert source["loadedFrom"] == "storage:hostpath" and source["hooksRun"], source
    assert source["loadSeconds"] is not None and source["gbps"] is not None, source
    source_pids = pids_of(stack, "vllmkill")
    assert source_pids
    gate = fault_gate(stack)
    faultgate.arm(gate, "vllmkill")
    try:
        stack.patch_md(
            "vllmkill",
            {"spec": {"replicas": 2, "loading": {"peerToPeer": {"transferTimeoutSeconds": 20}}}},
        )
        # The observer polls meanwhile: its created and scheduled marks (the summary's
        # timeline below) are taken as the target pod appears, not once the hold is over.
        obs.wait(
            lambda o: faultgate.holding(gate, "vllmkill") is not None,
            2 * READY_TIMEOUT,
            "the target's pull held after its first READ",
        )
        held = faultgate.holding(gate, "vllmkill")
        assert held is not None and held.peer == source["name"] and held.in_flight, held
        target_name = held.pod
        for pid in source_pids:  # the worker and vLLM (same process group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    finally:
        faultgate.disarm(gate, "vllmkill")  # the pull goes on against a dead peer
    obs.wait(
        lambda o: any(r["name"] == target_name and r.get("ready") for r in o.replica_statuses()),
        2 * READY_TIMEOUT,
        "the target Ready after losing its source",
    )
    target = next(r for r in obs.replica_statuses() if r["name"] == target_name)
    assert target["role"] == "Target", target
    assert target["loadedFrom"] == "storage:hostpath", target
    assert target["bytesLoaded"] == target["bytesTotal"] > 0
    assert target["hooksRun"] and target["loadSeconds"] is not None, target
    worker = _worker_status(obs, target_name)
    assert "peer-to-peer failed" in worker["message"] and source["name"] in worker["message"]
    steps = worker["timeline"]
    order = ["server", "engine", "hooks", "load", "processed", "serving"]
    assert [steps[s] for s in order] == sorted(steps[s] for s in order), steps
    row = next(r for r in obs.summary()["replicas"] if r["name"] == target_name)
    assert {"engine start", "hooks", "load", "vLLM processing"} <= set(row["timeline"]), row
    assert (
        complete(row["openaiEndpoint"], "vllmkill", probe["completion"])
        == probe["completion"]["expectedText"]
    )
    assert not any(alive(p) for p in source_pids)
    # The hook ran in each vLLM rank (one per replica here), device index = rank 0.
    inits = [ln.split() for ln in hook_log.read_text().splitlines() if ln.startswith("init ")]
    mine = [ln for ln in inits if Path(ln[1]).resolve() == model.resolve() and ln[2] == "0"]
    assert len(mine) >= 2, inits
