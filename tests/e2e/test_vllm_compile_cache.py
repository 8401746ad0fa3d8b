"""vLLM's compiled program travels instead of being compiled again (real vLLM, CPU, no cluster).

Compiled mode (no --enforce-eager), each replica with its own VLLM_CACHE_ROOT: a first start
compiles and vLLM saves its AOT artifact; a second start of the same model on the same node loads
it (vLLM's own log line says so); a target with an empty cache root fetches the Ready source's
cache over the P2P surface and loads it too, as two bare workers and on the process node. A
standby target compiles and warms up on placeholder weights before its hand-off, then answers
bit-identically (token ids and logprobs) to the storage-loaded replica it pulled from.
On the cluster, the node store outlives the replicas: a later deployment of the same model loads
the program a deleted one stored, and a store entry with a flipped byte is refused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.e2e import pids_of, wait_gone
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
from weightlift.api.worker import PEERS_FILE_ENV, PeerCandidate, PeerHandoff, WorkerPlan
from weightlift.bench.chaos_models import flip_a_byte
from weightlift.local.llm import vllm_worker_plan
from weightlift.local.observe import Observer, complete, pod_vllm_log
from weightlift.local.stack import LocalStack, model_deployment
from weightlift.worker.engines.vllm.compile_store import ARCHIVE
from weightlift.worker.engines.vllm.engine import engine_host

JSON = dict[str, Any]
# vLLM's default: torch.compile (Inductor on CPU) and its AOT artifact, for these tests only.
COMPILED_ARGS = [a for a in ENGINE_ARGS if a != "--enforce-eager"]
# vLLM's log lines (vllm/compilation/decorators.py, 0.32).
SAVED = "saved AOT compiled function to"
LOADED = "Directly load AOT compilation from path"
LOAD_FAILED = "Compiling model again due to a load failure"


class Worker(VllmWorker):
    """A vLLM worker with its own vLLM cache root; answers the completion probe."""

    def __init__(
        self,
        plan: WorkerPlan,
        workdir: Path,
        cache_root: Path,
        python: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(plan, workdir, python, cache_root=cache_root, env=env)

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
    cache: Path  # node A's vLLM cache root
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
    return NodeA(cache, first_status, first_log, second, second.wait_serving())


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
    # No peer and no store: the program vLLM found was left in this node's cache root.
    assert node_a.second_status["compileCache"] == "hit (store)", node_a.second_status
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
    assert st["compileCache"] == "hit (peer)", st
    assert st["loadedFrom"] == "peer:llm-0b", st
    log = target.vllm_log
    assert LOADED in log and str(cache) in log, log[-3000:]
    assert SAVED not in log and LOAD_FAILED not in log, log[-3000:]
    assert "compile cache" in target.log.read_text() and "installed" in target.log.read_text()
    assert target.complete(probe) == source.complete(probe) == probe["completion"]["expectedText"]


# The load format's log lines (engines/vllm/loader.py) and vLLM's end of engine start-up.
IN_PLACE = "weights in place after compile"
STANDBY_OVER = "standby over"
ENGINE_UP = "init engine (profile, create kv cache, warmup model)"
PROMPTS = ["hello world", "the quick brown fox", "one two three four five six seven"]


def greedy(worker: Worker, prompt: str) -> JSON:
    """Greedy token ids (as text pieces) and the top-5 logprobs of each step, as vLLM sends
    them: floats in JSON round-trip exactly, so equal dicts mean equal bits."""
    resp = httpx.post(
        f"http://{worker.address}/v1/completions",
        json={"model": "llm", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    logprobs: JSON = resp.json()["choices"][0]["logprobs"]
    return logprobs


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_warm_spare_compiles_first_and_answers_bit_identically(
    llm: tuple[Path, Path, JSON],
    node_a: NodeA,
    running: list[Worker],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A warm spare on node A (issue 33 item 3): its vLLM loads the compiled program, warms
    up on placeholder weights and answers /health while the worker still waits in Standby,
    not Ready. Handed node A's storage-loaded replica as its peer, it pulls the weights into
    the same tensors and redoes vLLM's post-load processing (CPU repacking): its greedy token
    ids and top-5 logprobs are bit-identical to that replica's."""
    python, model, probe = llm
    source = node_a.second
    work = tmp_path_factory.mktemp("standby")
    handoff = work / "peers.json"
    p = plan(model, "llm-2", Role.TARGET, []).model_copy(update={"spare": True})
    # The worker's own bound on the wait: beyond this test's slowest vLLM start.
    p = p.model_copy(
        update={"loading": p.loading.model_copy(update={"wait_for_source_seconds": 3600})}
    )
    target = Worker(p, work, node_a.cache, python, env={PEERS_FILE_ENV: str(handoff)})
    running.append(target)
    engine = f"http://{engine_host(p.host)}:{p.runtime.engine_port}"
    deadline = time.monotonic() + READY_TIMEOUT
    # The worker says Standby (the operator: a warm spare) only once vLLM has compiled, warmed
    # up and serves /health, with no weights yet.
    while phase(target) != "Standby":
        assert time.monotonic() < deadline and target.proc.poll() is None, target_log(target)
        time.sleep(0.5)
    assert healthy(engine), "the worker said Standby before vLLM answered /health"
    st = target.status()
    assert st["phase"] == "Standby" and "peers" not in st["timeline"], st
    log = target.vllm_log
    assert LOADED in log and SAVED not in log and IN_PLACE not in log, log[-3000:]
    tmp = handoff.with_suffix(".tmp")
    peer = PeerCandidate(pod=source.plan.pod_name, address=source.address)
    tmp.write_text(PeerHandoff(peers=[peer]).to_text())
    os.replace(tmp, handoff)
    st = target.wait_serving()
    assert st["loadedFrom"] == "peer:llm-0b" and st["bytesLoaded"] == st["bytesTotal"] > 0, st
    log = target.vllm_log
    # The engine was up (compiled, warmed up) before the weights came, then never compiled.
    assert log.index(ENGINE_UP) < log.index(STANDBY_OVER) < log.index(IN_PLACE), log[-3000:]
    assert SAVED not in log and LOAD_FAILED not in log, log[-3000:]
    for prompt in PROMPTS:
        assert greedy(target, prompt) == greedy(source, prompt), prompt
    assert target.complete(probe) == probe["completion"]["expectedText"]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def phase(worker: Worker) -> str | None:
    try:
        return str(worker.status().get("phase"))
    except (httpx.HTTPError, ValueError):  # its HTTP server is not up yet
        return None


def target_log(worker: Worker) -> str:
    try:
        return worker.vllm_log
    except OSError:
        return ""


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
    # The source found no usable entry in the stack's node store (empty, or another model path's
    # program, which vLLM's own key refuses) and compiled.
    assert source["compileCache"].startswith("miss ("), rows
    assert target["compileCache"] == "hit (peer)", rows
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


# ------------------------------------------------------------------------------ the node store
def deploy_one(stack: LocalStack, name: str, model: Path, probe: JSON) -> JSON:
    """One compiled vLLM replica of `model`, Ready: its replica status."""
    manifest = model_deployment(
        name,
        model,
        probe=probe,
        replicas=1,
        engine="vLLM",
        engine_args=COMPILED_ARGS,
        env=ENGINE_ENV,
        hook_library=None,
    )
    obs = Observer(stack, name)
    stack.apply(manifest)
    obs.wait_ready(READY_TIMEOUT)
    (row,) = obs.replica_statuses()
    (served,) = obs.summary()["replicas"]
    return {**row, **served}


def delete(stack: LocalStack, name: str) -> None:
    pids = pids_of(stack, name)
    stack.delete_md(name)
    wait_gone(stack, name, pids)


def store_archives(stack: LocalStack, since: float = 0.0) -> list[Path]:
    return [
        p for p in Path(stack.compile_store).glob(f"*/*/{ARCHIVE}") if p.stat().st_mtime >= since
    ]


def wait_stored(stack: LocalStack, since: float, timeout: float = 60.0) -> Path:
    """The entry a Ready replica put in the node store (it stores right after Ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = store_archives(stack, since)
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
        time.sleep(0.5)
    raise AssertionError(f"nothing stored in {stack.compile_store} since {since}")


@pytest.fixture(scope="module")
def stored(stack: LocalStack, llm: tuple[Path, Path, JSON]) -> Path:
    """A first deployment of the model, Ready (it compiled or used the store), then deleted:
    what it stored outlives it."""
    _, model, probe = llm
    since = time.time()
    deploy_one(stack, "vllmst-a", model, probe)
    archive = wait_stored(stack, since)
    delete(stack, "vllmst-a")
    return archive


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_deployment_after_the_first_is_deleted_installs_the_store_entry_and_never_compiles(
    stack: LocalStack, llm: tuple[Path, Path, JSON], stored: Path
) -> None:
    _, model, probe = llm
    since = time.time()
    try:
        row = deploy_one(stack, "vllmst-b", model, probe)
        assert row["compileCache"] == "hit (store)", row
        assert row["role"] == "Source" and not row.get("loadedFrom", "").startswith("peer"), row
        log = pod_vllm_log(row["name"], since)
        assert LOADED in log, log[-3000:]
        assert SAVED not in log and LOAD_FAILED not in log, log[-3000:]
        worker_log = "".join(
            p.read_text(errors="replace") for p in stack.node.pod_logs(stack.namespace, row["name"])
        )
        assert "from the node store installed" in worker_log, worker_log[-3000:]
        assert "vLLM should not compile" in worker_log, worker_log[-3000:]
        assert (
            complete(row["openaiEndpoint"], row["servedModelName"], probe["completion"])
            == (probe["completion"]["expectedText"])
        )
    finally:
        delete(stack, "vllmst-b")


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_store_entry_with_a_flipped_byte_is_refused_and_the_replica_compiles(
    stack: LocalStack, llm: tuple[Path, Path, JSON], stored: Path
) -> None:
    _, model, probe = llm
    flip_a_byte(stored)  # the model's entry (a later replica of it replaced it in place)
    since = time.time()
    try:
        row = deploy_one(stack, "vllmst-c", model, probe)
        cc = row["compileCache"]
        assert cc.startswith("miss (store entry refused: compile-cache file "), row
        assert cc.endswith("/model: sha256 differs from the manifest)"), row
        log = pod_vllm_log(row["name"], since)
        assert SAVED in log and LOADED not in log, log[-3000:]  # it compiled
        assert (
            complete(row["openaiEndpoint"], row["servedModelName"], probe["completion"])
            == (probe["completion"]["expectedText"])
        )
        # The refused entry was dropped and the replica stored a good one in its place.
        assert wait_stored(stack, since).read_bytes() != b""
    finally:
        delete(stack, "vllmst-c")
