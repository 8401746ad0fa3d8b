"""The fast subset of `weightlift bench chaos` on the session's stack: each scenario injects a
fault into the real control plane, operator or model files and must end converged, with no
orphan pod or worker process and no replica Ready with wrong weights. The group scenario
(replicas of 2 pods) runs with the real LeaderWorkerSet controller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weightlift.bench.chaos import SCENARIOS, run_scenario, scenario
from weightlift.bench.chaos_models import Models
from weightlift.local.lws import LwsController
from weightlift.local.stack import LocalStack

FAST = [s.name for s in SCENARIOS if s.fast and s.pods == 1]
GROUPS_FAST = [s.name for s in SCENARIOS if s.fast and s.pods > 1]


@pytest.fixture(scope="module")
def chaos_models(e2e_dir: Path, demo_model: tuple[Path, dict[str, Any]]) -> Models:
    return Models(e2e_dir / "chaos", good=demo_model[0])


def _converges(stack: LocalStack, models: Models, name: str) -> None:
    index, sc = scenario(name)
    result = run_scenario(stack, models, sc, index)
    assert result.converged, result
    assert result.orphans == 0, result
    assert result.wrong_weights == 0, result
    stack.check_operator()


@pytest.mark.parametrize("name", FAST)
def test_fault_scenario_converges(stack: LocalStack, chaos_models: Models, name: str) -> None:
    _converges(stack, chaos_models, name)


@pytest.mark.parametrize("name", GROUPS_FAST)
def test_group_fault_scenario_converges(
    stack: LocalStack, lws: LwsController, chaos_models: Models, name: str
) -> None:
    """The same, with the LeaderWorkerSet controller running (`lws`)."""
    _converges(stack, chaos_models, name)
