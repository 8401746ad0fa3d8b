"""Replicas that span pods on the real node (issue 47): LeaderWorkerSet groups (the real LWS
controller) whose pods run as containers under the pinned kubelet, their worker images pulled
from the stack's registry, each pod in its own network namespace on the node's bridge.

First the builtin runtime: 2 groups x 2 pods (tensor 2, one rank per pod); the source group
reads storage, the target's pod i pulls its rank from the source's pod i over the pod network,
each group computes across its two pods (gloo between containers). Then vLLM, tensor 2 over 2
pods (worker-vllm): every pod runs one vLLM node, the leader its OpenAI server, the other
headless (the mp executor; its TCPStore, gloo and ZMQ between the pods' addresses); each pod
loads only its own rank, the target group's pod i from the source group's pod i over NIXL; both
leaders give transformers' greedy text. The operator runs as a process of this checkout.
Needs root, `make node`, `make images`, `make lws` and `make vllm-env` (the tiny Llama)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_kubelet_lifecycle import _require_images
from tests.e2e.test_kubelet_node import _require_node
from tests.e2e.test_lws_groups import shard_bytes
from tests.support.vllm import READY_TIMEOUT as VLLM_READY_TIMEOUT
from tests.support.vllm import require_vllm_python, tiny_llm
from weightlift.local.kubeletnode import KubeletNode
from weightlift.local.kubeletnode.network import POD_BASE
from weightlift.local.lws import LwsController, LwsError, lws_dir
from weightlift.local.observe import Observer, complete, infer
from weightlift.local.stack import (
    VLLM_ENGINE_ARGS,
    VLLM_ENV,
    LocalStack,
    engine_image,
    make_demo_model,
    model_deployment,
)
from weightlift.operator.settings import PROBE_NETWORKS_ENV

JSON = dict[str, Any]
BUILTIN = "kgrp"
VLLM = "kvgrp"
GROUPS = {"tensor": 2, "podsPerReplica": 2}
# Each pod's one local rank on its own core (the pod's share of a one-pod TP 2's "0|1").
THREADS_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
BUILTIN_READY_TIMEOUT = 600.0
pytestmark = pytest.mark.timeout(1800)


def _require_lws() -> None:
    try:
        lws_dir()
    except LwsError as exc:
        if os.environ.get("WEIGHTLIFT_REQUIRE_NODE"):
            pytest.fail(f"{exc} [WEIGHTLIFT_REQUIRE_NODE is set]", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The models' folder: the operator's hostpath prefix, mounted into the pods."""
    return tmp_path_factory.mktemp("kgmodels")


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[LocalStack]:
    _require_node()
    _require_lws()
    stack = LocalStack(
        tmp_path_factory.mktemp("kgroups") / "stack",
        node_kind="kubelet",
        node_name="kubelet-groups",
        gpus=4,  # two groups of two pods, one GPU (rank) each; one deployment at a time
        model_path_prefixes=(str(models),),
        # The tests' safety belt (tests/conftest.py) lets the operator contact loopback only;
        # this node's pods live on its bridge, on this machine too.
        operator_env={PROBE_NETWORKS_ENV: f"127.0.0.0/8,{POD_BASE}"},
    )
    # worker-vllm shares the worker's layers: the registry and containerd hold them once.
    stack.images = (*stack.node_images(), engine_image("vLLM"))
    _require_images(stack.images)
    with stack:
        yield stack
    node = stack.node
    assert isinstance(node, KubeletNode)
    assert not node.leftovers()


@pytest.fixture(scope="module")
def klws(kstack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The real LeaderWorkerSet controller against the stack (its webhooks gone before it)."""
    with LwsController(kstack.kubeconfig, tmp_path_factory.mktemp("klws")):
        yield


def _node(stack: LocalStack) -> KubeletNode:
    assert isinstance(stack.node, KubeletNode)
    return stack.node


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


def _wait_groups(stack: LocalStack, obs: Observer, timeout: float) -> tuple[JSON, JSON]:
    deadline = time.monotonic() + timeout
    rows = None
    while rows is None and time.monotonic() < deadline:
        stack.check_operator()
        rows = _groups_ready(obs)
        time.sleep(1)
    assert rows is not None, f"both groups of {obs.name} not Ready\n{stack.operator_log_tail()}"
    by_role = {r["role"]: r for r in rows}
    assert set(by_role) == {"Source", "Target"}, rows
    return by_role["Source"], by_role["Target"]


def _check_containers(stack: LocalStack, name: str, image: str) -> None:
    """Every pod of the groups: the image's container under the kubelet, in a network
    namespace of its own (not the host's, none shared), its IP on the node's pod network."""
    node = _node(stack)
    prefix = node.net.pod_cidr.rsplit(".", 1)[0] + "."
    pods = stack.pods(name)
    assert len(pods) == 4, [p["metadata"]["name"] for p in pods]
    netns = set()
    for pod in pods:
        assert {c["image"] for c in pod["spec"]["containers"]} == {image}
        assert pod["status"]["podIP"].startswith(prefix), pod["status"]
        (pid, *_) = node.pids()[f"{stack.namespace}/{pod['metadata']['name']}"]
        netns.add(os.readlink(f"/proc/{pid}/ns/net"))
    assert os.readlink("/proc/self/ns/net") not in netns and len(netns) == 4, netns


def _delete(stack: LocalStack, obs: Observer, name: str) -> None:
    stack.delete_md(name)
    obs.wait(lambda o: not o.pods and o.md is None, 180, f"{name} to go")


def _rank_matched(source: JSON, target: JSON) -> None:
    for group in (source, target):
        pods = group["pods"]
        assert [p["index"] for p in pods] == [0, 1], pods
        assert [p["ranks"] for p in pods] == [[0], [1]], "each pod drives its own rank"
    assert [p["loadedFrom"] for p in source["pods"]] == ["storage:hostpath"] * 2, source
    assert [p["loadedFrom"] for p in target["pods"]] == [
        f"peer:{p['name']}" for p in source["pods"]
    ], target


def test_builtin_groups_run_as_containers_rank_matched_over_the_pod_network(
    kstack: LocalStack, klws: None, models: Path
) -> None:
    model_dir = models / "tp2"
    probe = make_demo_model(model_dir, 4.0, tp=2, hook=True, seed=3)
    obs = Observer(kstack, BUILTIN)
    kstack.apply(model_deployment(BUILTIN, model_dir, replicas=2, probe=probe, parallelism=GROUPS))
    started = time.monotonic()
    source, target = _wait_groups(kstack, obs, BUILTIN_READY_TIMEOUT)
    print(f"\nboth builtin groups Ready {time.monotonic() - started:.0f}s after apply")
    _rank_matched(source, target)
    for group in (source, target):
        for index, pod in enumerate(group["pods"]):
            own = shard_bytes(model_dir / f"rank-{index}-of-2.safetensors")
            assert pod["bytesLoaded"] == pod["bytesTotal"] == own, pod
    _check_containers(kstack, BUILTIN, engine_image("Builtin"))
    # Each leader computes across its group's two containers; a follower serves no inference.
    expected = probe["expectedOutputs"][0]["data"]
    for group in (source, target):
        leader, follower = group["pods"]
        out = infer(f"http://{leader['podIP']}:8000", BUILTIN, probe["request"])
        got = out["outputs"][0]["data"]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3
        refused = httpx.post(
            f"http://{follower['podIP']}:8000/v2/models/{BUILTIN}/infer",
            json=probe["request"],
            timeout=10,
        )
        assert refused.status_code == 421, refused.text
    _delete(kstack, obs, BUILTIN)


def test_vllm_tp2_over_two_containers_per_replica_rank_matched_greedy_text(
    kstack: LocalStack, klws: None, models: Path
) -> None:
    model_dir = models / "llm"
    probe = tiny_llm(require_vllm_python(), model_dir)
    obs = Observer(kstack, VLLM)
    kstack.apply(
        model_deployment(
            VLLM,
            model_dir,
            replicas=2,
            probe=probe,
            engine="vLLM",
            engine_args=VLLM_ENGINE_ARGS,  # eager: compiling twice per group costs minutes
            env={**VLLM_ENV, **THREADS_BIND},
            parallelism=GROUPS,
            hook_library=None,
            image=engine_image("vLLM"),
            # Its wait begins at the pods' creation: pulling worker-vllm's own layers and the
            # source group's vLLM start on 2 busy cores come first.
            wait_for_source_seconds=int(VLLM_READY_TIMEOUT),
        )
    )
    started = time.monotonic()
    source, target = _wait_groups(kstack, obs, 2 * VLLM_READY_TIMEOUT)
    print(f"\nboth vLLM groups Ready {time.monotonic() - started:.0f}s after apply")
    _rank_matched(source, target)
    for s_pod, t_pod in zip(source["pods"], target["pods"], strict=True):
        # A source pod reads the whole checkpoint (vLLM slices its rank out); a target pod
        # pulls exactly its rank's parameters (checksums verified), well under the whole.
        assert 0 < t_pod["bytesLoaded"] == t_pod["bytesTotal"] < s_pod["bytesTotal"], t_pod
    _check_containers(kstack, VLLM, engine_image("vLLM"))
    # Both leaders' OpenAI endpoints (their workers', over the pod network) give transformers'
    # greedy text; a headless pod serves no API.
    expected = probe["completion"]["expectedText"]
    for group in (source, target):
        leader, follower = group["pods"]
        assert complete(f"http://{leader['podIP']}:8000/v1", VLLM, probe["completion"]) == expected
        refused = httpx.post(
            f"http://{follower['podIP']}:8000/v1/completions",
            json={"model": VLLM, "prompt": "hi", "max_tokens": 1},
            timeout=10,
        )
        assert refused.status_code == 421, refused.text
    _delete(kstack, obs, VLLM)
