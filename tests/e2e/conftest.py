"""E2E tier: real control plane + process node + operator + real worker processes.

One LocalStack per session (torn down by the fixture, also on failure); each test makes its own
ModelDeployment and the `deployments` fixture deletes them and waits until every pod and every
worker process is gone. Skips when the control-plane binaries are absent, unless
WEIGHTLIFT_REQUIRE_CLUSTER is set (CI / `make test`), then it fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import pids_of, wait_gone
from tests.support.proctree import ProcessRecorder, wait_none_run
from tests.support.triton import triton_worker_env
from tests.support.vllm import vllm_worker_env
from weightlift.local.lws import LwsController, LwsError, lws_dir
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

HERE = Path(__file__).resolve().parent
MODEL_MB = 8.0

JSON = dict[str, Any]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:  # a module may ask for more
                item.add_marker(pytest.mark.timeout(600))


def _require_binaries() -> None:
    from weightlift.local.cluster import CONTROLPLANE_BINARIES, controlplane_bin_dir

    missing = [
        b for b in CONTROLPLANE_BINARIES if not os.access(controlplane_bin_dir() / b, os.X_OK)
    ]
    if not missing:
        return
    msg = f"control plane binaries missing: {', '.join(missing)}; run `make controlplane`"
    if os.environ.get("WEIGHTLIFT_REQUIRE_CLUSTER"):
        pytest.fail(msg + " [WEIGHTLIFT_REQUIRE_CLUSTER is set]", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def demo_model(e2e_dir: Path) -> tuple[Path, JSON]:
    """A small PT2 demo model with a real init hook (gcc) and its probe.json."""
    out = e2e_dir / "model"
    probe = make_demo_model(out, MODEL_MB)
    return out, probe


@pytest.fixture(scope="session")
def hook_log(e2e_dir: Path) -> Path:
    return e2e_dir / "hooks.log"


@pytest.fixture(scope="session")
def worker_processes() -> Iterator[ProcessRecorder]:
    """Every worker process of the session's stack and every process below it (vLLM's engine
    core, tritonserver and its backend stubs, ...), recorded while they ran (the `stack` fixture
    starts it). Torn down after the stack, which depends on it: then not one of them may run."""
    recorder = ProcessRecorder()
    yield recorder
    recorder.stop()
    # The node's stop SIGKILLed every worker's process group; a process of another group or
    # session (or re-parented to init) that outlived it is a leak.
    left = wait_none_run(recorder.seen(), timeout=30.0)
    assert not recorder.errors, f"the process recorder failed: {recorder.errors}"
    assert not left, "worker processes left behind after teardown:\n" + "\n".join(map(str, left))


@pytest.fixture(scope="session")
def stack(
    e2e_dir: Path,
    hook_log: Path,
    tmp_path_factory: pytest.TempPathFactory,
    worker_processes: ProcessRecorder,
) -> Iterator[LocalStack]:
    _require_binaries()
    s = LocalStack(
        e2e_dir / "stack",
        node_name="e2e-node",
        # hostpath:// models: the demo model and the tests' own copies, all below pytest's temp
        model_path_prefixes=(str(tmp_path_factory.getbasetemp()),),
        worker_env={
            "WEIGHTLIFT_HOOK_LOG": str(hook_log),
            "CUDA_VISIBLE_DEVICES": "",
            **vllm_worker_env(),
            **triton_worker_env(),
        },
    )
    with s:
        worker_processes.start(s.node.pids)
        try:
            yield s
        finally:
            worker_processes.record()  # what runs right before the stop
            worker_processes.stop()
    # `worker_processes` checks, after this teardown, that none of them is left.


@pytest.fixture(scope="session")
def lws(stack: LocalStack, e2e_dir: Path) -> Iterator[LwsController]:
    """The real LeaderWorkerSet controller (`make lws`) against the session's stack."""
    try:
        lws_dir()
    except LwsError as exc:
        if os.environ.get("WEIGHTLIFT_REQUIRE_CLUSTER"):
            pytest.fail(f"{exc} [WEIGHTLIFT_REQUIRE_CLUSTER is set]", pytrace=False)
        pytest.skip(str(exc))
    with LwsController(stack.kubeconfig, e2e_dir / "lws") as controller:
        yield controller


@pytest.fixture
def deployments(
    stack: LocalStack, worker_processes: ProcessRecorder
) -> Iterator[Callable[..., Observer]]:
    """`deploy(name, model_dir, probe, **kw)` applies a ModelDeployment and returns an Observer;
    everything it made is deleted (and waited for) after the test: its pods, and every worker
    process of them and every process below one that `worker_processes` saw during the test."""
    made: list[str] = []

    def deploy(name: str, model_dir: Path, probe: JSON | None, **kw: Any) -> Observer:
        manifest = model_deployment(name, model_dir, probe=probe, **kw)
        obs = Observer(stack, name)
        stack.apply(manifest)
        made.append(name)
        return obs

    yield deploy
    worker_processes.record()  # what runs right before the deletes
    errors = []
    for name in made:
        pids = set(pids_of(stack, name))
        if stack.get_md(name) is not None:
            stack.delete_md(name)
        try:
            wait_gone(stack, name, sorted(pids))
        except AssertionError as exc:
            errors.append(str(exc))
    for name in made:
        procs = worker_processes.seen(lambda owner, n=name: owner.split("/")[1].startswith(f"{n}-"))
        left = wait_none_run(procs, timeout=30.0)
        if left:
            errors.append(
                f"{name}: processes left after its pods are gone: {[str(p) for p in left]}"
            )
    assert not errors, errors


@pytest.fixture
def bad_hook_model(demo_model: tuple[Path, JSON], tmp_path: Path) -> Path:
    """A copy of the demo model whose hook library lacks triton_pytorch_model_init."""
    src, _ = demo_model
    out = tmp_path / "model-bad-hook"
    shutil.copytree(src, out)
    c_file = out / "hooks" / "libbad.c"
    c_file.write_text("int weightlift_not_the_init_symbol(void) { return 0; }\n")
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is needed to build the bad hook library"
    import subprocess

    subprocess.run(
        [gcc, "-shared", "-fPIC", "-o", str(out / "hooks" / "libbad.so"), str(c_file)], check=True
    )
    return out
