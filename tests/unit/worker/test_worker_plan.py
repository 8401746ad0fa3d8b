"""The worker reads its plan from the operator's ConfigMap file and refuses any other content."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worker import make_plan, plan_env
from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    PLAN_FILE_ENV,
    PLAN_SHA256_ENV,
    WorkerPlan,
    WorkerReport,
)
from weightlift.worker.plan import PlanRefused, read_plan


def test_the_plan_read_back_is_the_plan_written(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, peers=[{"pod": "src-0", "address": "10.0.0.5:8000"}], role="Target")
    assert read_plan(plan_env(plan, tmp_path)) == plan


def test_split_and_compose_are_inverse(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, tp=2, probe={"request": {"inputs": []}})
    assert WorkerPlan.compose(*plan.split()) == plan


def test_a_tampered_plan_is_refused_naming_the_configmap_and_the_digests(tmp_path: Path) -> None:
    env = plan_env(make_plan(tmp_path), tmp_path, configmap="llama-plan-0123456789ab")
    path = Path(env[PLAN_FILE_ENV])
    doc = json.loads(path.read_text())
    doc["initHooks"] = {"library": "/tmp/evil.so"}
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanRefused) as refused:
        read_plan(env)
    message = str(refused.value)
    assert "ConfigMap llama-plan-0123456789ab" in message
    assert env[PLAN_SHA256_ENV] in message and "is not the operator's" in message


def test_one_changed_byte_is_enough(tmp_path: Path) -> None:
    env = plan_env(make_plan(tmp_path), tmp_path)
    path = Path(env[PLAN_FILE_ENV])
    path.write_text(path.read_text() + " ")  # same JSON, other bytes
    with pytest.raises(PlanRefused, match="sha256"):
        read_plan(env)


def test_missing_pieces_are_named(tmp_path: Path) -> None:
    env = plan_env(make_plan(tmp_path), tmp_path)
    with pytest.raises(PlanRefused, match=ASSIGNMENT_ENV):
        read_plan({k: v for k, v in env.items() if k != ASSIGNMENT_ENV})
    Path(env[PLAN_FILE_ENV]).unlink()
    with pytest.raises(PlanRefused, match="cannot read the plan of ConfigMap"):
        read_plan(env)


def test_the_worker_process_refuses_a_tampered_plan_and_never_serves(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    env = plan_env(plan, tmp_path, configmap="demo-plan-feedfacecafe")
    path = Path(env[PLAN_FILE_ENV])
    path.write_text(path.read_text().replace('"demo"', '"other"'))
    term = tmp_path / "termination-log"
    proc = subprocess.run(
        [sys.executable, "-m", "weightlift", "worker"],
        env={**os.environ, **env, "WEIGHTLIFT_TERMINATION_LOG": str(term)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "ConfigMap demo-plan-feedfacecafe" in proc.stderr and "sha256" in proc.stderr
    report = WorkerReport.model_validate_json(term.read_text())
    assert report.phase == "Failed" and report.permanent_failure
    assert "is not the operator's" in report.message
