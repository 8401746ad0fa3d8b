"""The scale-out report's arithmetic: the fan-out tree, the source, the ideal and the ratio."""

from __future__ import annotations

import math

import pytest

from weightlift.bench.scaleout import FanOut


def replica(name: str, origin: str, ready: float, load: float) -> dict[str, object]:
    return {"name": name, "loadedFrom": origin, "secondsToReady": ready, "loadSeconds": load}


def test_a_doubling_fan_out_is_measured_against_its_ideal() -> None:
    fan = FanOut(
        replicas=[
            replica("a", "storage:hostpath", 4.0, 1.0),
            replica("b", "peer:a", 6.0, 0.5),
            replica("c", "peer:a", 6.5, 0.5),
            replica("d", "peer:b", 8.0, 0.7),
        ],
        seconds_to_all_ready=9.0,
    )
    assert fan.source is not None and fan.source["name"] == "a"
    assert [fan.depth(n) for n in "abcd"] == [0, 1, 1, 2]
    ideal = 4.0 + math.log2(4) * 0.5  # the median pull of 0.5, 0.5, 0.7
    doc = fan.to_json()
    assert doc["idealSeconds"] == pytest.approx(ideal)
    assert doc["ratioToIdeal"] == pytest.approx(9.0 / ideal, abs=1e-3)
    assert doc["maxDepth"] == 2
    assert doc["pulledFrom"]["d"] == "peer:b"


def test_no_pull_means_no_ideal_and_a_loop_does_not_recurse_forever() -> None:
    stored = FanOut([replica("a", "storage:hostpath", 4.0, 1.0)], seconds_to_all_ready=4.0)
    assert stored.ideal_seconds() is None and stored.to_json()["ratioToIdeal"] is None
    loop = FanOut(
        [replica("a", "peer:b", 5.0, 0.5), replica("b", "peer:a", 5.0, 0.5)],
        seconds_to_all_ready=5.0,
    )
    assert loop.source is None and loop.depth("a") <= 2
