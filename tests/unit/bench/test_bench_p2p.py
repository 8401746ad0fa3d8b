"""bench p2p's ratios: a pull against the limits and storage of the same run, the standby pull's
READs alone against a copy into new memory, and like with like when both ran in workers."""

from __future__ import annotations

import pytest

from weightlift.bench.p2p import _ratios


def test_pull_ratios_against_the_same_runs_limits_and_storage() -> None:
    result = {
        "limits": {"memcpy_gbps": 4.0, "memcpy_fresh_gbps": 2.0},
        "storage": {"gbps": 1.0},
        "storage_worker": {"gbps": 0.5},
    }
    standby = {"gbps": 1.5, "bytes": 3_000_000_000, "phases": {"transfer": 1.0}}
    _ratios(standby, result)
    assert standby["ratio_to_memcpy"] == pytest.approx(0.375)
    assert standby["ratio_to_memcpy_fresh"] == pytest.approx(0.75)
    assert standby["ratio_to_storage_cold"] == pytest.approx(1.5)
    assert standby["ratio_to_storage_worker_cold"] == pytest.approx(3.0)
    assert standby["transfer_gbps"] == pytest.approx(3.0)
    assert standby["transfer_ratio_to_memcpy_fresh"] == pytest.approx(1.5)


def test_a_transfer_rate_measured_by_the_peer_mode_is_kept() -> None:
    result = {"limits": {"memcpy_gbps": 4.0, "memcpy_fresh_gbps": 2.0}, "storage": {"gbps": 1.0}}
    pulls = {"gbps": 1.0, "bytes": 10, "transfer_gbps": 1.0, "phases": {"transfer": 1.0}}
    _ratios(pulls, result)
    assert pulls["transfer_gbps"] == 1.0 and "ratio_to_storage_worker_cold" not in pulls
    assert pulls["transfer_ratio_to_memcpy_fresh"] == pytest.approx(0.5)
