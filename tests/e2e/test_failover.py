"""A standby operator on the real stack: two `weightlift operator --leader-elect` processes,
the active one SIGKILLed mid-rollout (Targets in Standby, the source loading); the other takes
the Lease within the lease time and finishes the rollout with no replica pod created twice
(every pod's uid, from a watch), no status lost and no role changed. The chaos bench's
`leader-sigkill-standby-takes-over` scenario, with its own checks (bench/chaos_failover.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightlift.bench.chaos import Models, run_scenario, scenario
from weightlift.local.stack import LocalStack


@pytest.fixture
def failover_stack(stack: LocalStack) -> Iterator[LocalStack]:
    yield stack
    if stack.election is not None:  # the scenario failed before it restored the plain operator
        stack.use_leader_election(None)


def test_standby_operator_takes_over_mid_rollout(
    failover_stack: LocalStack, e2e_dir: Path, demo_model: tuple[Path, dict[str, Any]]
) -> None:
    models = Models(e2e_dir / "failover", good=demo_model[0])
    index, sc = scenario("leader-sigkill-standby-takes-over")
    result = run_scenario(failover_stack, models, sc, index)
    assert result.converged, result
    assert result.orphans == 0 and result.wrong_weights == 0, result
    assert result.detail.startswith("takeover "), result
    print(f"{sc.name}: {result.detail} (converged {result.seconds}s after the kill)")
    failover_stack.check_operator()
