"""The benches' results as panels of the bar chart: ours, the peers, the limits, the ratios."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from PIL import Image

from weightlift.bench.charts import (
    load_panels,
    operator_panels,
    p2p_panels,
    remote_panels,
    vllm_panels,
)
from weightlift.bench.operator import plot_against_floor
from weightlift.local.plot import Limit


def test_bench_load_panels_hold_ours_against_peers_and_the_limits() -> None:
    doc = {
        "limits": {"memcpy_gbps": 10.0, "odirect_read_gbps": 2.0},
        "results": [
            {"loader": n, "cache": c, "gbps": g}
            for n, c, g in (
                ("weightlift-preload", "warm", 20.0),
                ("safetensors", "warm", 5.0),
                ("weightlift-preload", "cold", 1.5),
                ("safetensors", "cold", 1.0),
            )
        ],
    }
    warm, cold = load_panels(doc)
    assert [(b.label, b.value, b.ours) for b in warm.bars] == [
        ("weightlift-preload", 20.0, True),
        ("safetensors", 5.0, False),
    ]
    assert warm.bars[0].note == "2.00x memcpy\n4.00x best peer"
    assert warm.limits == [Limit("memcpy (threads)", 10.0)]
    assert cold.bars[0].note == "0.75x O_DIRECT\n1.50x best peer"
    assert cold.bars[1].note == "0.50x O_DIRECT"


def test_bench_load_uri_panel_holds_the_contenders_against_the_stores_raw_gets() -> None:
    doc = {
        "uri": "s3://bench/model",
        "limits": {"memcpy_gbps": 9.0, "s3_ranged_get_gbps": 2.0},
        "results": [
            {"loader": "weightlift", "gbps": 1.5},
            {"loader": "runai-model-streamer-s3", "gbps": 0.75},
            {"loader": "boto3-download-then-load", "gbps": 0.5},
        ],
    }
    (panel,) = remote_panels(doc)
    assert panel.limits == [Limit("s3 ranged get", 2.0)]  # memcpy left out
    assert [(b.ours, b.note) for b in panel.bars] == [
        (True, "0.75x raw GETs\n2.00x best peer"),
        (False, "0.38x raw GETs"),
        (False, "0.25x raw GETs"),
    ]


def test_bench_p2p_and_vllm_panels() -> None:
    p2p = {
        "limits": {"memcpy_gbps": 8.0, "memcpy_fresh_gbps": 2.0},
        "p2p": {"gbps": 1.0, "ready_seconds": 2.5},
        "p2p_standby": {"gbps": 4.0},
        "storage_worker": {"gbps": 2.0, "ready_seconds": 5.0},
        "storage": {"gbps": 3.0},
        "storage_warm": {"gbps": 6.0},
    }
    gbps, ready = p2p_panels(p2p)
    assert [b.ours for b in gbps.bars] == [True, True, False, False, False]
    assert [b.note for b in gbps.bars][:2] == ["0.50x new memory", "2.00x new memory"]
    assert [lim.value for lim in gbps.limits] == [8.0, 2.0]
    assert [b.value for b in ready.bars] == [2.5, 5.0] and ready.bars[
        0
    ].note == "2.00x storage's speed"
    rows = {"auto": {"ready_s": 40.0, "gbps": 1.0}, "p2p+cache": {"ready_s": 20.0, "gbps": 3.0}}
    start, load = vllm_panels({"rows": rows})
    assert [(b.label, b.ours, b.note) for b in start.bars] == [
        ("auto", False, "1.00x auto's speed"),
        ("p2p+cache", True, "2.00x auto's speed"),
    ]
    assert [b.value for b in load.bars] == [1.0, 3.0]
    triton = {"triton-auto": {"ready_s": 15.0}, "triton-p2p": {"ready_s": 15.0, "gbps": None}}
    (start,) = vllm_panels({"rows": triton}, "triton-auto")  # no load GB/s: no second panel
    assert [b.note for b in start.bars] == ["1.00x triton-auto's speed"] * 2
    assert start.peers == "triton-auto"


def _ready(p50: float, p90: float, everyone: float) -> dict[str, dict[str, float]]:
    return {"deployments_ready": {"p50": p50, "p90": p90, "all": everyone}}


OPERATOR = {
    "deployments": 1000,
    "replicas": 4,
    "milestones_seconds": _ready(50.0, 90.0, 160.0),
    "api_requests": {"ramp_per_deployment": 13.0},
}
FLOOR = {"deployments": 1000, "milestones_seconds": _ready(40.0, 80.0, 100.0)}


def test_bench_operator_panels_pair_each_share_with_the_floors() -> None:
    (ready,) = operator_panels(OPERATOR, FLOOR)  # a floor.json without its requests: one panel
    assert [(b.label, b.value, b.ours) for b in ready.bars] == [
        ("operator, 50%", 50.0, True),
        ("floor, 50%", 40.0, False),
        ("operator, 90%", 90.0, True),
        ("floor, 90%", 80.0, False),
        ("operator, all", 160.0, True),
        ("floor, all", 100.0, False),
    ]
    assert [b.note for b in ready.bars if b.ours] == ["1.25x floor", "1.12x floor", "1.60x floor"]
    floor = {**FLOOR, "api_requests": {"ramp_per_deployment": 6.5}}
    _, calls = operator_panels(OPERATOR, floor)
    assert [b.value for b in calls.bars] == [13.0, 6.5] and calls.bars[0].note == "2.00x floor"


def test_bench_operator_plot_reads_the_floor_run(tmp_path: Path) -> None:
    with pytest.raises(click.ClickException, match="run --floor first"):
        plot_against_floor(OPERATOR, tmp_path / "floor.json", tmp_path / "x.png")
    (tmp_path / "floor.json").write_text(json.dumps(FLOOR))
    png = plot_against_floor(OPERATOR, tmp_path / "floor.json", tmp_path / "op.png")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (660, 480)
