"""Pictures: the demo's Gantt chart and the benches' bar charts, drawn from fixed results, and
`weightlift demo --from-json … --plot` (no stack)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.patches import Rectangle
from PIL import Image

from weightlift.local.demo import demo_command
from weightlift.local.demo_plot import PHASES, plot_demo, timeline_lanes
from weightlift.local.plot import DPI, Bar, Lane, Limit, Panel, bar_chart, gantt, save

# What `weightlift demo --json` writes (observe.Observer.summary, less the operator's block).
SUMMARY = {
    "phase": "Ready",
    "secondsToReady": 8.9,
    "replicas": [
        {
            "name": "demo-0",
            "role": "Source",
            "loadedFrom": "storage",
            "endpoint": "http://127.0.1.2:8000",
            "hooksRun": True,
            "loadSeconds": 1.5,
            "gbps": 0.04,
            "compileCache": None,
            "createdAt": 0.3,
            "readyAt": 7.35,
            "timeline": {
                "scheduling": 0.25,
                "process start": 0.5,
                "imports + server": 3.0,
                "fetch": 0.1,
                "hooks": 0.4,
                "load": 1.5,
                "bind": 0.3,
                "serve": 0.2,
                "probe": 0.5,
            },
        },
        {
            "name": "demo-1",
            "role": "Target",
            "loadedFrom": "peer:demo-0",
            "endpoint": "http://127.0.1.3:8000",
            "hooksRun": True,
            "loadSeconds": 0.6,
            "gbps": 0.11,
            "compileCache": None,
            "createdAt": 0.3,
            "standbyAt": 5.55,
            "readyAt": 8.85,
            "timeline": {
                "scheduling": 0.25,
                "process start": 0.5,
                "imports + server": 3.1,
                "hooks": 0.4,
                "standby": 1.0,
                "wait for peers": 2.0,
                "load": 0.6,
                "serve": 0.2,
                "probe": 0.5,
            },
        },
    ],
}


def _rectangles(fig: object) -> list[Rectangle]:
    (ax,) = fig.axes  # type: ignore[attr-defined]
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_the_gantt_draws_one_segment_per_replica_and_step_where_the_table_puts_it(
    tmp_path: Path,
) -> None:
    lanes = timeline_lanes(SUMMARY)
    fig = gantt(lanes, PHASES, "t", "s")
    rects = _rectangles(fig)
    assert len(rects) == sum(len(r["timeline"]) for r in SUMMARY["replicas"]) == 18
    # Each row is contiguous from createdAt, in the table's step order, and ends at Ready.
    for row, replica in enumerate(SUMMARY["replicas"]):
        mine = sorted((r for r in rects if abs(r.get_y() + 0.3 - row) < 1e-6), key=Rectangle.get_x)
        widths = [r.get_width() for r in mine]
        steps = replica["timeline"]
        assert widths == pytest.approx([steps[p] for p in PHASES if p in steps])
        assert mine[0].get_x() == replica["createdAt"]
        for a, b in itertools.pairwise(mine):
            assert abs(a.get_x() + a.get_width() - b.get_x()) < 1e-9
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names[0].startswith("demo-0\nSource") and names[1].startswith("demo-1\nTarget")
    # One legend entry per phase drawn, the target's standby and wait among them.
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [p for p in PHASES if any(p in r["timeline"] for r in SUMMARY["replicas"])]
    assert {"standby", "wait for peers"} <= set(legend)
    png = plot_demo(SUMMARY, tmp_path / "d" / "demo.png")
    with Image.open(png) as im:
        assert im.format == "PNG"
        w, h = fig.get_size_inches()
        assert im.size == (round(w * DPI), round(h * DPI))


def test_the_bar_chart_draws_each_bar_with_its_ratio_and_each_limit(tmp_path: Path) -> None:
    panel = Panel(
        "warm",
        "GB/s",
        [Bar("ours", 3.0, True, "1.50x limit"), Bar("theirs", 1.0, False, "0.50x limit")],
        [Limit("memcpy", 2.0)],
    )
    fig = bar_chart([panel, Panel("cold", "GB/s", [Bar("ours", 0.5, True)])], "t")
    warm, cold = fig.axes
    heights = [r.get_height() for r in warm.patches if isinstance(r, Rectangle)]
    assert heights == [3.0, 1.0]
    colours = {r.get_facecolor() for r in warm.patches if isinstance(r, Rectangle)}
    assert len(colours) == 2  # ours and the peers told apart
    texts = [t.get_text() for t in warm.texts]
    assert texts == ["3.00\n1.50x limit", "1.00\n0.50x limit"]
    assert [line.get_ydata()[0] for line in warm.get_lines()] == [2.0]
    legend = [t.get_text() for t in warm.get_legend().get_texts()]
    assert legend == ["memcpy", "weightlift", "peers"]
    assert [t.get_text() for t in warm.get_xticklabels()] == ["ours", "theirs"]
    assert len([p for p in cold.patches if isinstance(p, Rectangle)]) == 1
    png = save(fig, tmp_path / "b.png")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (960, 480)


def test_demo_from_json_prints_the_tables_and_draws_without_a_stack(tmp_path: Path) -> None:
    saved = tmp_path / "summary.json"
    saved.write_text(json.dumps(SUMMARY))
    png = tmp_path / "timeline.png"
    res = CliRunner().invoke(demo_command, ["--from-json", str(saved), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "where each replica's seconds went" in res.output and "demo-1" in res.output
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] == 1000


def test_lanes_keep_the_replicas_order_and_skip_missing_steps() -> None:
    lanes = timeline_lanes({"replicas": [{"name": "a", "timeline": {}}, *SUMMARY["replicas"]]})
    assert [lane.name.split("\n")[0] for lane in lanes] == ["a", "demo-0", "demo-1"]
    assert lanes[0] == Lane("a\n- ← -", 0.0, [])
    assert [s for s, _ in lanes[2].steps][-4:] == ["wait for peers", "load", "serve", "probe"]


def test_matplotlib_loads_only_when_a_picture_is_drawn() -> None:
    """The commands with --plot import no matplotlib until they draw (CLI start-up stays fast)."""
    code = (
        "import sys, weightlift.local.demo, weightlift.local.demo_plot, weightlift.bench.charts, "
        "weightlift.bench.operator; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
