"""Real vLLM (CPU) under two real weightlift workers, no cluster: a source loads from storage
with weightlift's preload inside vLLM, a target pulls the checkpoint over NIXL from it through
the source worker's port, and both answer the same greedy completion as transformers did."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.vllm import (
    ENGINE_ARGS,
    TEST_TIMEOUT,
    VllmWorker,
    require_vllm_python,
    tiny_llm,
)
from weightlift.api.model import Role
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.local.llm import vllm_worker_plan

JSON = dict[str, Any]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return require_vllm_python()


@pytest.fixture(scope="module")
def llm(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JSON]:
    out = tmp_path_factory.mktemp("tiny-llm")
    return out, tiny_llm(vllm_python, out)


# Tensor parallelism on CPU: one worker process per rank (`mp`), each bound to its own core.
TP2_ARGS = [a if a != "uni" else "mp" for a in ENGINE_ARGS]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _plan(model: Path, pod: str, role: Role, peers: list[PeerCandidate], tp: int = 1) -> WorkerPlan:
    return vllm_worker_plan(model, pod, role, peers, ENGINE_ARGS if tp == 1 else TP2_ARGS, tp=tp)


class RunningWorker(VllmWorker):
    def __init__(self, plan: WorkerPlan, workdir: Path, vllm_python: Path) -> None:
        env = TP2_ENV if plan.tensor_parallel > 1 else {}
        super().__init__(plan, workdir, vllm_python, env=env)


@pytest.fixture
def workers(tmp_path: Path, vllm_python: Path) -> Iterator[list[RunningWorker]]:
    started: list[RunningWorker] = []
    yield started
    for w in started:
        w.stop()
    for w in started:
        assert w.proc.returncode == 0, f"{w.plan.pod_name} exit {w.proc.returncode}"


def _complete(address: str, probe: JSON) -> str:
    c = probe["completion"]
    body = {"model": "llm", "prompt": c["prompt"], "max_tokens": c["maxTokens"], "temperature": 0}
    resp = httpx.post(f"http://{address}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["text"]
    return text


def _logprobs(address: str, probe: JSON) -> list[dict[str, float]]:
    c = probe["completion"]
    body = {
        "model": "llm",
        "prompt": c["prompt"],
        "max_tokens": c["maxTokens"],
        "temperature": 0,
        "logprobs": 5,
    }
    resp = httpx.post(f"http://{address}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    top: list[dict[str, float]] = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == c["maxTokens"] and all(len(step) >= 1 for step in top), top
    return top


@pytest.mark.timeout(TEST_TIMEOUT)
def test_source_preloads_target_pulls_p2p_both_complete_like_transformers(
    llm: tuple[Path, JSON], workers: list[RunningWorker], tmp_path: Path, vllm_python: Path
) -> None:
    model, probe = llm
    expected = probe["completion"]["expectedText"]
    source = RunningWorker(_plan(model, "llm-0", Role.SOURCE, []), tmp_path / "src", vllm_python)
    workers.append(source)
    st = source.wait_serving()
    assert st["loadedFrom"] == "storage:file" and st["strategy"] == "preload", st
    assert st["bytesLoaded"] == st["bytesTotal"] > 0
    assert _complete(source.address, probe) == expected

    peer = PeerCandidate(pod="llm-0", address=source.address)
    target = RunningWorker(
        _plan(model, "llm-1", Role.TARGET, [peer]), tmp_path / "tgt", vllm_python
    )
    workers.append(target)
    st = target.wait_serving()
    assert st["loadedFrom"] == "peer:llm-0" and st["strategy"] == "p2p", st
    assert st["bytesLoaded"] == st["bytesTotal"] == source.status()["bytesTotal"]
    # The same greedy text through the worker's /v1 front door; vLLM's own port refuses the
    # same request (it takes only the key the worker holds): no way around the Ready gate.
    assert _complete(target.address, probe) == expected
    c = probe["completion"]
    body = {"model": "llm", "prompt": c["prompt"], "max_tokens": c["maxTokens"], "temperature": 0}
    direct = httpx.post(
        f"http://127.0.0.1:{target.plan.runtime.engine_port}/v1/completions", json=body, timeout=60
    )
    assert direct.status_code == 401, direct.text
    # Not just the same text: the same numbers. The log-probabilities of the top tokens at every
    # step are bit-identical between the storage-loaded source and the P2P target.
    assert _logprobs(target.address, probe) == _logprobs(source.address, probe)
    # Triton's generate extension, answered through vLLM.
    gen = httpx.post(
        f"http://{target.address}/v2/models/llm/generate",
        json={
            "text_input": probe["completion"]["prompt"],
            "parameters": {"max_tokens": probe["completion"]["maxTokens"]},
        },
        timeout=60,
    )
    assert gen.status_code == 200 and gen.json()["text_output"] == expected, gen.text
    # The source's manifest server (inside vLLM, behind the worker) saw one verified read.
    health = httpx.get(f"http://{source.address}/weightlift/v1/p2p/health", timeout=5).json()
    assert health["completed_reads"] == 1 and health["failed_reads"] == 0, health
    # The target publishes too: later replicas can pull from it.
    health = httpx.get(f"http://{target.address}/weightlift/v1/p2p/health", timeout=5).json()
    assert health["pod"] == "llm-1" and health["identity"] == "llm-tiny"
    reports = json.loads((tmp_path / "tgt" / "llm-1" / "reports" / "rank-0.json").read_text())
    assert reports["ok"] and reports["loadedFrom"] == "peer:llm-0"


def _rank_report(workdir: Path, pod: str, rank: int) -> JSON:
    report: JSON = json.loads((workdir / pod / "reports" / f"rank-{rank}.json").read_text())
    return report


@pytest.mark.timeout(TEST_TIMEOUT)
def test_tp2_each_target_rank_pulls_only_its_own_rank(
    llm: tuple[Path, JSON], workers: list[RunningWorker], tmp_path: Path, vllm_python: Path
) -> None:
    """Tensor parallel 2: each vLLM rank of the source publishes its own parameters, each rank
    of the target pulls only its rank's (about half the checkpoint) and both replicas answer
    the same greedy text."""
    model, probe = llm
    source = RunningWorker(
        _plan(model, "tp-0", Role.SOURCE, [], tp=2), tmp_path / "src", vllm_python
    )
    workers.append(source)
    st = source.wait_serving()
    assert st["loadedFrom"] == "storage:file", st
    text = _complete(source.address, probe)
    peer = PeerCandidate(pod="tp-0", address=source.address)
    target = RunningWorker(
        _plan(model, "tp-1", Role.TARGET, [peer], tp=2), tmp_path / "tgt", vllm_python
    )
    workers.append(target)
    st = target.wait_serving()
    assert st["loadedFrom"] == "peer:tp-0" and st["strategy"] == "p2p", st
    assert _complete(target.address, probe) == text
    checkpoint = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for rank in (0, 1):
        src = _rank_report(tmp_path / "src", "tp-0", rank)
        tgt = _rank_report(tmp_path / "tgt", "tp-1", rank)
        assert src["loadedFrom"] == "storage:file" and tgt["loadedFrom"] == "peer:tp-0", tgt
        # The source's rank read the whole checkpoint; the target's only its own share.
        assert src["bytesLoaded"] > 0.9 * checkpoint, (src, checkpoint)
        assert 0 < tgt["bytesLoaded"] < 0.75 * checkpoint, (tgt, checkpoint)
        # Each of the source's ranks served one verified read, from its own process.
        health = httpx.get(
            f"http://{source.address}/weightlift/v1/p2p/health", params={"rank": rank}, timeout=5
        ).json()
        assert health["ranks"] == [rank] and health["completed_reads"] == 1, health
