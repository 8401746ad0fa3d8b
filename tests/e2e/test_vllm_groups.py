"""vLLM across pods (issue 47): 2 replicas x 2 pods (tensor 2, one rank per pod) on the process
node, through the real LeaderWorkerSet controller. Each pod runs one vLLM node (`vllm serve
--nnodes 2 --node-rank i`, the mp executor over gloo): the leader the OpenAI server, the other
headless. The source group's pods load their own rank from storage; the target group's pod i
pulls its rank from the source group's pod i; both leaders give transformers' greedy text."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.vllm import (
    ENGINE_ARGS,
    ENGINE_ENV,
    READY_TIMEOUT,
    TEST_TIMEOUT,
    require_vllm_python,
    tiny_llm,
)
from weightlift.local.lws import LwsController
from weightlift.local.observe import Observer, complete
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
NAME = "vgrp"
# Each pod's one local rank on its own core (the pod's share of a one-pod TP 2's "0|1").
THREADS_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _groups_ready(obs: Observer) -> list[JSON] | None:
    """Both groups' rows once Ready; an AssertionError at the first pod that failed (a group pod
    failed for good waits, never exits: the test would otherwise wait out its timeout)."""
    obs.poll()
    rows = obs.replica_statuses()
    failed = [p for r in rows for p in r.get("pods") or [] if p.get("phase") == "Failed"]
    assert not failed, f"a group pod failed: {failed[0]['name']}: {failed[0].get('message')}"
    if obs.status().get("readyReplicas") == 2 and len(rows) == 2 and all(r["ready"] for r in rows):
        return rows
    return None


@pytest.mark.timeout(TEST_TIMEOUT)
def test_vllm_tp2_over_two_pods_per_replica_rank_matched_p2p_greedy_text(
    stack: LocalStack,
    lws: LwsController,
    deployments: Callable[..., Observer],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    python = require_vllm_python()
    model = tmp_path_factory.mktemp("vllm-groups")
    probe = tiny_llm(python, model)
    started = time.monotonic()
    obs = deployments(
        NAME,
        model,
        probe,
        replicas=2,
        engine="vLLM",
        engine_args=ENGINE_ARGS,
        env={**ENGINE_ENV, **THREADS_BIND},
        parallelism={"tensor": 2, "podsPerReplica": 2},
        hook_library=None,
    )
    deadline = time.monotonic() + 2 * READY_TIMEOUT
    rows = None
    while rows is None and time.monotonic() < deadline:
        stack.check_operator()
        rows = _groups_ready(obs)
        time.sleep(1)
    assert rows is not None, f"both vLLM groups not Ready\n{stack.operator_log_tail()}"
    print(f"\nboth vLLM groups Ready {time.monotonic() - started:.0f}s after apply")

    by_role = {r["role"]: r for r in rows}
    assert set(by_role) == {"Source", "Target"}, rows
    source, target = by_role["Source"], by_role["Target"]
    for group in (source, target):
        pods = group["pods"]
        assert [p["index"] for p in pods] == [0, 1], pods
        assert [p["ranks"] for p in pods] == [[0], [1]], "each pod drives its own rank"
    # The source group's pods read storage; the target's pod i pulled from the source's pod i.
    assert [p["loadedFrom"] for p in source["pods"]] == ["storage:hostpath"] * 2, source
    assert [p["loadedFrom"] for p in target["pods"]] == [
        f"peer:{p['name']}" for p in source["pods"]
    ], target
    for s_pod, t_pod in zip(source["pods"], target["pods"], strict=True):
        # A source pod reads the whole checkpoint (vLLM slices its rank out); a target pod
        # pulls exactly its rank's parameters (checksums verified), well under the whole.
        assert 0 < t_pod["bytesLoaded"] == t_pod["bytesTotal"] < s_pod["bytesTotal"], t_pod

    # Both leaders' OpenAI endpoints (through their workers) give transformers' greedy text;
    # a headless pod serves no API.
    expected = probe["completion"]["expectedText"]
    for group in (source, target):
        leader, follower = group["pods"]
        assert complete(f"http://{leader['podIP']}:8000/v1", NAME, probe["completion"]) == expected
        refused = httpx.post(
            f"http://{follower['podIP']}:8000/v1/completions",
            json={"model": NAME, "prompt": "hi", "max_tokens": 1},
            timeout=10,
        )
        assert refused.status_code == 421, refused.text
