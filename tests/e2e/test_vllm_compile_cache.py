"""vLLM's compiled program travels instead of being compiled again (real vLLM, CPU, no cluster).

Compiled mode (no --enforce-eager), each replica with its own VLLM_CACHE_ROOT: a first start
compiles and vLLM saves its AOT artifact; a second start of the same model on the same node loads
it (vLLM's own log line says so); a target with an empty cache root fetches the Ready source's
cache over the P2P surface and loads it too, as two bare workers and on the process node.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm import (
    ENGINE_ARGS,
    ENGINE_ENV,
    READY_TIMEOUT,
    TEST_TIMEOUT,
    VllmWorker,
    require_vllm_python,
    tiny_llm,
)
from weightlift.api.model import Role
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.local.llm import vllm_worker_plan
from weightlift.local.observe import Observer, complete
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
# vLLM's default: torch.compile (Inductor on CPU) and its AOT artifact, for these tests only.
COMPILED_ARGS = [a for a in ENGINE_ARGS if a != "--enforce-eager"]
# vLLM's log lines (vllm/compilation/decorators.py, 0.32).
SAVED = "saved AOT compiled function to"
LOADED = "Directly load AOT compilation from path"
LOAD_FAILED = "Compiling model again due to a load failure"


class Worker(VllmWorker):
    """A vLLM worker with its own vLLM cache root; answers the completion probe."""

    def __init__(self, plan: WorkerPlan, workdir: Path, cache_root: Path, python: Path) -> None:
        super().__init__(plan, workdir, python, cache_root=cache_root)

    def complete(self, probe: JSON) -> str:
        return complete(f"http://{self.address}/v1", "llm", probe["completion"], timeout=120)


def plan(model: Path, pod: str, role: Role, peers: list[PeerCandidate]) -> WorkerPlan:
    # The same model path string on every replica: part of vLLM's cache key.
    return vllm_worker_plan(model, pod, role, peers, COMPILED_ARGS)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, JSON]:
    python = require_vllm_python()
    out = tmp_path_factory.mktemp("tiny-llm")
    return python, out, tiny_llm(python, out)


@pytest.fixture(scope="module")
def running() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    codes = {w.plan.pod_name: w.stop() for w in started}
    assert all(code == 0 for code in codes.values()), codes


@dataclass
class NodeA:
    first_status: JSON
    first_log: str
    second: Worker  # still running: the source of the next test
    second_status: JSON


@pytest.fixture(scope="module")
def node_a(
    llm: tuple[Path, Path, JSON], running: list[Worker], tmp_path_factory: pytest.TempPathFactory
) -> NodeA:
    """Two starts of one model on one node (one cache root): the first compiles, the second
    should load what the first compiled. The second keeps running."""
    python, model, _ = llm
    work = tmp_path_factory.mktemp("node-a")
    cache = tmp_path_factory.mktemp("node-a-vllm-cache")
    first = Worker(plan(model, "llm-0", Role.SOURCE, []), work, cache, python)
    running.append(first)
    first_status = first.wait_serving()
    first_log = first.vllm_log
    assert first.stop() == 0
    running.remove(first)
    second = Worker(plan(model, "llm-0b", Role.SOURCE, []), work, cache, python)
    running.append(second)
    return NodeA(first_status, first_log, second, second.wait_serving())


@pytest.mark.timeout(TEST_TIMEOUT)
def test_second_start_on_a_node_loads_the_compiled_artifact(
    llm: tuple[Path, Path, JSON], node_a: NodeA
) -> None:
    _, _, probe = llm
    assert SAVED in node_a.first_log and LOADED not in node_a.first_log, node_a.first_log[-3000:]
    assert node_a.first_status["compileCache"] == "none", node_a.first_status
    log = node_a.second.vllm_log
    assert LOADED in log, log[-3000:]
    assert LOAD_FAILED not in log and SAVED not in log, log[-3000:]
    assert node_a.second_status["compileCache"] == "hit", node_a.second_status
    assert node_a.second.complete(probe) == probe["completion"]["expectedText"]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_target_installs_the_source_cache_and_compiles_nothing(
    llm: tuple[Path, Path, JSON],
    node_a: NodeA,
    running: list[Worker],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A target on another node (its own empty cache root) fetches the Ready source's compile
    cache over the P2P surface, verifies and installs it: its vLLM loads the program instead of
    compiling, and answers the same greedy text."""
    python, model, probe = llm
    source = node_a.second
    cache = tmp_path_factory.mktemp("node-b-vllm-cache")
    peer = PeerCandidate(pod=source.plan.pod_name, address=source.address)
    target = Worker(
        plan(model, "llm-1", Role.TARGET, [peer]), tmp_path_factory.mktemp("node-b"), cache, python
    )
    running.append(target)
    st = target.wait_serving()
    assert st["compileCache"] == "hit", st
    assert st["loadedFrom"] == "peer:llm-0b", st
    log = target.vllm_log
    assert LOADED in log and str(cache) in log, log[-3000:]
    assert SAVED not in log and LOAD_FAILED not in log, log[-3000:]
    assert "compile cache" in target.log.read_text() and "installed" in target.log.read_text()
    assert target.complete(probe) == source.complete(probe) == probe["completion"]["expectedText"]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_on_the_cluster_a_vllm_target_loads_its_source_compiled_program(
    stack: LocalStack,
    deployments: Callable[..., Observer],
    llm: tuple[Path, Path, JSON],
) -> None:
    """The operator plans a source and a P2P target (compiled mode, each pod its own vLLM cache
    root): the target's status says compileCache hit, its vLLM log shows no compile, and both
    answer transformers' greedy text."""
    _, model, probe = llm
    since = time.time()
    obs = deployments(
        "vllmcc",
        model,
        probe,
        replicas=2,
        engine="vLLM",
        engine_args=COMPILED_ARGS,
        env=ENGINE_ENV,
        hook_library=None,
    )
    obs.wait_ready(2 * READY_TIMEOUT)
    rows = obs.replica_statuses()
    source = next(r for r in rows if r["role"] == "Source")
    target = next(r for r in rows if r["role"] == "Target")
    assert target["loadedFrom"] == f"peer:{source['name']}", rows
    assert source["compileCache"] == "none" and target["compileCache"] == "hit", rows
    source_log = pod_vllm_log(source["name"], since)
    target_log = pod_vllm_log(target["name"], since)
    assert SAVED in source_log, source_log[-3000:]
    assert LOADED in target_log, target_log[-3000:]
    assert SAVED not in target_log and LOAD_FAILED not in target_log, target_log[-3000:]
    texts = [
        complete(r["openaiEndpoint"], r["servedModelName"], probe["completion"])
        for r in obs.summary()["replicas"]
    ]
    assert texts == [probe["completion"]["expectedText"]] * 2


def pod_vllm_log(pod: str, since: float) -> str:
    """A process-node pod's vLLM log: its worker keeps vLLM's files in a new temp folder named
    after the pod (engine.VllmEngine.for_worker) when WEIGHTLIFT_ENGINE_DIR is not set."""
    found = [
        p
        for p in Path(tempfile.gettempdir()).glob(f"wl-vllm-{pod}-*/vllm.log")
        if p.stat().st_mtime >= since
    ]
    assert found, f"no vLLM log of {pod} under {tempfile.gettempdir()}"
    return max(found, key=lambda p: p.stat().st_mtime).read_text(errors="replace")
