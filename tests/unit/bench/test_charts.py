"""The benches' results as panels of the bar chart: ours, the peers, the limits, the ratios."""

from __future__ import annotations

from weightlift.bench.charts import load_panels, p2p_panels, vllm_panels
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
    assert [b.value for b in ready.bars] == [2.5, 5.0] and ready.bars[0].note == "2.00x sooner"
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
