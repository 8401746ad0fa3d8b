"""`weightlift bench operator` at 5 x 2: its own control plane (with the audit log), simulated
workers and the real operator; every deployment must get Ready through real probes and the
report must account for what happened."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster import REPO
from weightlift.bench.operator_floor import floor_requests
from weightlift.local.cluster import missing_binaries

pytestmark = pytest.mark.slow

# The operator's API requests per deployment while 2 replicas get Ready, by the audit log's kind
# (issue 34): what each one is for. More of a kind, or a kind not here, fails the test: a new
# request per deployment is budgeted on purpose, here, or not made.
BUDGET_PER_DEPLOYMENT = {
    "create pods": 2,  # its replicas
    "create configmaps": 1,  # its plan (shared_objects.py)
    "create secrets": 1,  # the P2P token of its model identity
    "patch modeldeployments": 1,  # kopf's finalizer; sources are found by selectableFields
    "list modeldeployments": 1,  # published sources before a storage load (kopf's index lags)
    "patch pods": 1,  # the target's hand-off, once (not again while the index lags)
    "create events": 1,  # PhaseReady: progress phases post none (planning.EVENT_PHASES)
    "patch services": 1,  # its Service (issue 45): one server-side apply per operator life
    # One write per state change (Pending, Loading, first source published, Ready), progress
    # within a phase coalesced (statuswrites.py): one write every 5 s at most, so a loaded
    # machine's slower ramp may add some; two on average are allowed.
    "patch modeldeployments/status": 6,
}
# Not per deployment: the operator's GPU check (nodes, cached a minute) and kopf's watches
# starting again (server timeout 60 s) while the ramp runs.
OPERATOR_WIDE = {"list nodes": 2, "watch pods": 2, "watch modeldeployments": 2}


def test_bench_operator_small_scale(state_root: Path) -> None:
    if missing_binaries():
        pytest.skip("control plane binaries missing (see test_cluster_live for the failure)")
    state = state_root / "bench-operator"
    out = state / "result.json"
    argv = [str(REPO / ".venv" / "bin" / "weightlift"), "bench", "operator"]
    argv += ["--deployments", "5", "--replicas", "2", "--steady-seconds", "3"]
    argv += ["--timeout", "180", "--state-dir", str(state), "--json-out", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert result["all_ready"] and result["ready_deployments"] == 5
    assert result["seconds_to_all_ready"] > 0
    milestones = result["milestones_seconds"]
    assert milestones["pods_ready_in_kwok"]["all"] <= milestones["deployments_ready"]["all"]
    # The audit log saw the operator create exactly the 10 worker pods and write statuses.
    ramp = result["api_requests"]["ramp_by_kind"]
    assert ramp["create pods"] == 10
    assert ramp["patch modeldeployments/status"] >= 5
    assert result["api_requests"]["errors"] == {}
    # Every pod was reached at its own loopback address by the operator's real probes.
    assert result["simulated_workers"]["pod_addresses"] == 10
    assert result["operator"]["peak_rss_mb"] > 20
    assert "apply -> all Ready" in run.stdout
    # Each deployment's way to Ready, step by step: all 5 went through every step, and the
    # steps' owners add up to no more than the whole run.
    phases = result["phases_seconds"]
    assert phases["first pod created [operator]"]["max"] is not None
    assert phases["all pods Ready -> deployment Ready [operator]"]["max"] is not None
    assert phases["other pods Ready in kwok [kwok]"]["max"] <= result["seconds_to_all_ready"]
    cpu = result["ramp_cpu_seconds_by_process"]
    assert cpu["operator"] > 0 and cpu["kube-apiserver"] > 0 and "kwok" in cpu
    assert result["api_requests"]["ramp_per_deployment"] >= 2  # its two pods at least
    _assert_within_budget(result["api_requests"], deployments=5)
    assert "per deployment" in run.stdout and "floor" in run.stdout


def _assert_within_budget(api: dict[str, object], deployments: int) -> None:
    ramp = api["ramp_by_kind"]
    assert isinstance(ramp, dict)
    unbudgeted = set(ramp) - BUDGET_PER_DEPLOYMENT.keys() - OPERATOR_WIDE.keys()
    assert not unbudgeted, f"requests of no budgeted kind: {unbudgeted} in {ramp}"
    over = {
        kind: f"{count}/{deployments} > {BUDGET_PER_DEPLOYMENT[kind]}"
        for kind, count in ramp.items()
        if kind in BUDGET_PER_DEPLOYMENT and count > BUDGET_PER_DEPLOYMENT[kind] * deployments
    }
    over |= {
        kind: f"{count} > {OPERATOR_WIDE[kind]}"
        for kind, count in ramp.items()
        if kind in OPERATOR_WIDE and count > OPERATOR_WIDE[kind]
    }
    assert not over, f"over the request budget: {over} (all: {ramp})"
    # The pods are made exactly once each (no 409s from a pass that did not see them).
    assert ramp["create pods"] == 2 * deployments


def test_bench_operator_floor_small_scale(state_root: Path) -> None:
    """--floor: no operator; the bench's own pods (the operator's manifests) get Ready."""
    if missing_binaries():
        pytest.skip("control plane binaries missing (see test_cluster_live for the failure)")
    state = state_root / "bench-operator-floor"
    out = state / "floor.json"
    argv = [str(REPO / ".venv" / "bin" / "weightlift"), "bench", "operator", "--floor"]
    argv += ["--deployments", "5", "--replicas", "2", "--timeout", "180"]
    argv += ["--state-dir", str(state), "--json-out", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert result["pods"] == 10 and result["all_ready"]
    # What the floor sent in the operator's place is what `bench operator` shows as the floor.
    assert result["requests_per_deployment"] == floor_requests(2)
    assert result["api_requests"]["ramp_per_deployment"] == 3  # 2 pods, 1 status write
    assert "operator" not in result["cpu_seconds_by_process"]
    assert result["cpu_seconds_by_process"]["kube-apiserver"] > 0
    assert "control plane alone" in run.stdout
