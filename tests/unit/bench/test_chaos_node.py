"""The real node's chaos scenarios (bench/chaos_node.py), without a stack: their wiring into
`weightlift bench chaos --node kubelet`, the manifest they deploy (a memory limit the operator
accepts), what they read in pod versions (OOMKilled, Unschedulable, an eviction), where a fault
struck, and the OOM helper against a real memory cgroup: the kernel kills the victim at the
cgroup's limit, not the helper (root and cgroup v1 only; under a second)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from click.testing import CliRunner

from weightlift.api.model import ModelDeploymentSpec
from weightlift.bench import chaos_node
from weightlift.bench.chaos import NODE_SCENARIOS, SCENARIOS, chaos_command, scenario
from weightlift.bench.chaos_models import Models
from weightlift.bench.chaos_run import Run, ScenarioSkipped
from weightlift.local.history import Version
from weightlift.worker.p2p.faultgate import Held

JSON = dict[str, Any]
FIVE = [
    "oom-killed-while-loading",
    "kubelet-restart-mid-pull",
    "containerd-restart-mid-pull",
    "drained-holding-the-only-source",
    "node-rebooted-mid-pull",
]


def test_the_five_node_faults_are_their_own_set_with_one_in_make_test() -> None:
    assert [s.name for s in NODE_SCENARIOS] == FIVE
    for s in NODE_SCENARIOS:
        assert s.replicas == 2 and s.verify is not None and s.refuses is None, s.name
    assert [s.name for s in NODE_SCENARIOS if s.fast] == ["kubelet-restart-mid-pull"]
    # Named chaos<index>: unique across both sets, found by the same lookup.
    indices = [scenario(s.name)[0] for s in (*SCENARIOS, *NODE_SCENARIOS)]
    assert len(set(indices)) == len(indices)
    assert scenario("node-rebooted-mid-pull")[1] is NODE_SCENARIOS[-1]


def test_the_command_lists_and_picks_by_node_kind() -> None:
    runner = CliRunner()
    listed = runner.invoke(chaos_command, ["--node", "kubelet", "--list"])
    assert listed.exit_code == 0 and listed.output.split() == FIVE
    process = runner.invoke(chaos_command, ["--list"])
    assert process.output.split() == [s.name for s in SCENARIOS]
    wrong = runner.invoke(
        chaos_command, ["--node", "kubelet", "--scenario", "source-sigkill-while-pulling"]
    )
    assert wrong.exit_code == 2 and "source-sigkill-while-pulling" in wrong.output


def test_on_a_process_node_a_node_fault_is_skipped_saying_why() -> None:
    run = cast(Run, SimpleNamespace(stack=SimpleNamespace(node=object())))
    with pytest.raises(ScenarioSkipped, match="--node kubelet"):
        chaos_node.node_of(run)


def test_the_deployment_limits_the_worker_container_memory_as_the_operator_accepts(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good"
    good.mkdir()
    request = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    outputs = [{"name": "OUTPUT0", "shape": [1, 1], "data": [3.0]}]
    probe = {"request": request, "expectedOutputs": outputs, "tolerance": 0.001}
    (good / "probe.json").write_text(json.dumps(probe))
    applied: list[JSON] = []
    stack = SimpleNamespace(apply=applied.append)
    run = cast(Run, SimpleNamespace(name="chaos9", models=Models(tmp_path, tmp_path / "good")))
    run.stack = stack  # type: ignore[assignment]
    chaos_node.deploy_limited(run, 2)
    (manifest,) = applied
    spec = ModelDeploymentSpec.model_validate(manifest["spec"])
    assert spec.replicas == 2
    assert spec.template.resources.limits == {"memory": chaos_node.MEMORY_LIMIT}


def _version(status: JSON, kind: str = "MODIFIED") -> Version:
    obj = {"metadata": {"name": "p", "uid": "u", "resourceVersion": "1"}, "status": status}
    return Version(kind, obj, 0.0)


def test_what_the_scenarios_read_in_pod_versions() -> None:
    oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    error = {"terminated": {"reason": "Error", "exitCode": 1}}
    assert chaos_node.oom_killed_reason(_version({"containerStatuses": [{"state": oom}]})) == (
        "OOMKilled exit 137"
    )
    assert chaos_node.oom_killed_reason(_version({"containerStatuses": [{"state": error}]})) is None
    parked = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    assert chaos_node.unschedulable(_version({"conditions": [parked]}))
    assert not chaos_node.unschedulable(_version({"conditions": [{"type": "PodScheduled"}]}))
    evicted = {"type": "DisruptionTarget", "reason": "EvictionByEvictionAPI"}
    assert chaos_node.evicted_by_api(_version({"conditions": [evicted]}))
    deleted = {"type": "DisruptionTarget", "reason": "DeletionByTaintManager"}
    assert not chaos_node.evicted_by_api(_version({"conditions": [deleted]}))


def test_struck_says_which_pull_how_far_and_when() -> None:
    held = Held("chaos9-abc123-1", "chaos9-abc123-0", "10.0.0.2:1", 0, 1, 1, 8, 10, 80)
    run = SimpleNamespace(name="chaos9", fault_at=112.4, notes={"held": held, "applied": 100.0})
    assert chaos_node.struck(cast(Run, run)) == "abc123-1 at READ 1/8 <- abc123-0 +12s"


MEMORY = Path("/sys/fs/cgroup/memory")
VICTIM = (
    "import sys, time; sys.stdin.readline(); b = b'1' * (32 << 20); "
    "print('ready', flush=True); time.sleep(120)"
)


def test_the_oom_helper_fills_a_memory_cgroup_until_the_kernel_kills_the_victim() -> None:
    if os.geteuid() != 0 or not (MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and the cgroup v1 memory controller")
    cgroup = MEMORY / f"wl-test-oom-{os.getpid()}"
    cgroup.mkdir()
    # 32 MiB of its own, as a worker holds far more: the kernel's badness scales the adj of
    # 1000 by whole thousandths of the limit, so a victim of a few pages could lose to the helper.
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM], stdout=subprocess.PIPE, stdin=subprocess.PIPE
    )
    try:
        assert victim.stdin is not None and victim.stdout is not None
        (cgroup / "memory.limit_in_bytes").write_text(str(128 << 20))
        (cgroup / "cgroup.procs").write_text(str(victim.pid))
        victim.stdin.write(b"go\n")  # it allocates in the cgroup: charged to it
        victim.stdin.flush()
        assert victim.stdout.readline() == b"ready\n"
        Path(f"/proc/{victim.pid}/oom_score_adj").write_text("1000")
        started = time.monotonic()
        hog = subprocess.run(
            [sys.executable, "-c", chaos_node.HOG, str(cgroup), str(256 << 20), str(victim.pid)],
            timeout=60,
            check=False,
        )
        assert hog.returncode == 0, "the helper reached its cap: no victim was killed"
        assert victim.wait(timeout=10) == -signal.SIGKILL
        control = dict(
            line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines()
        )
        assert int(control.get("oom_kill", "1")) >= 1, control
        print(f"OOM helper: victim killed in {time.monotonic() - started:.2f}s")
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        deadline = time.monotonic() + 10
        while cgroup.exists() and time.monotonic() < deadline:
            try:
                cgroup.rmdir()
            except OSError:
                time.sleep(0.1)
