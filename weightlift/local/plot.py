"""Pictures of the demo and the benchmarks: a Gantt chart of replicas' timelines, and bars of
ours against the peers and the machine's limits.

The one place that draws. The callers turn their own results into `Lane`s or `Panel`s;
matplotlib (the `bench` extra) loads only when a picture is drawn, so the CLI starts fast, and
only its Agg canvas is used (no pyplot, no display, no global state). Never imported by the
operator or the worker (`.importlinter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

OURS, PEER = "#1f77b4", "#9e9e9e"
DPI = 100


@dataclass(frozen=True)
class Lane:
    """One Gantt row: its steps, in order, from `start` (seconds since the chart's zero)."""

    name: str
    start: float
    steps: Sequence[tuple[str, float]]


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    ours: bool
    note: str = ""  # drawn above the bar, e.g. "0.53x memcpy"


@dataclass(frozen=True)
class Limit:
    """A horizontal line: what the machine itself does (memcpy, an O_DIRECT read)."""

    label: str
    value: float


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    bars: Sequence[Bar]
    limits: Sequence[Limit] = ()
    peers: str = "peers"  # what the grey bars are


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as exc:  # an install without the bench extra
        raise RuntimeError("pictures need matplotlib: pip install 'weightlift[bench]'") from exc

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def gantt(lanes: Sequence[Lane], phases: Sequence[str], title: str, xlabel: str) -> Figure:
    """One row per lane (the first on top), one rectangle per step, one colour per phase (in
    `phases` order, so every picture colours a phase alike); each row ends with its total."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    colour = {p: cmap(i % cmap.N) for i, p in enumerate(phases)}
    fig = _figure(10.0, 1.6 + 0.55 * len(lanes))
    ax = fig.subplots()
    end = max((lane.start + sum(s for _, s in lane.steps) for lane in lanes), default=1.0) or 1.0
    legend: dict[str, BarContainer] = {}
    for row, lane in enumerate(lanes):
        at = lane.start
        for phase, seconds in lane.steps:
            bar = ax.barh(row, seconds, left=at, height=0.6, color=colour.get(phase, PEER))
            legend.setdefault(phase, bar)
            if seconds > 0.06 * end:  # a number where it fits
                ax.text(at + seconds / 2, row, f"{seconds:.1f}", ha="center", va="center", size=8)
            at += seconds
        ax.text(at + 0.005 * end, row, f" {at:.1f} s", va="center", size=9)
    ax.set_yticks(range(len(lanes)), [lane.name for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.12)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    drawn = [p for p in phases if p in legend] + [p for p in legend if p not in phases]
    ax.legend(
        [legend[p] for p in drawn],
        drawn,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
        ncols=7,
        fontsize=8,
        frameon=False,
    )
    return fig


def bar_chart(panels: Sequence[Panel], title: str) -> Figure:
    """Panels side by side: ours in blue, peers in grey, limits as dashed lines."""
    # Room for each bar's labels: about an inch a bar, at least 4.8 a panel.
    widths = [max(4.8, 1.1 * len(p.bars)) for p in panels]
    fig = _figure(max(6.0, sum(widths)), 4.8)
    axes = fig.subplots(1, len(panels), squeeze=False, width_ratios=widths)[0]
    for ax, panel in zip(axes, panels, strict=True):
        _draw_panel(ax, panel)
    fig.suptitle(title)
    return fig


def _draw_panel(ax: Axes, panel: Panel) -> None:
    x = range(len(panel.bars))
    values = [b.value for b in panel.bars]
    drawn = ax.bar(x, values, color=[OURS if b.ours else PEER for b in panel.bars])
    ax.bar_label(
        drawn,
        [f"{b.value:.2f}" + (f"\n{b.note}" if b.note else "") for b in panel.bars],
        size=7,
        padding=2,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9, "pad": 0.5},
    )
    for i, limit in enumerate(panel.limits):
        ax.axhline(limit.value, color="k", ls=("--", ":", "-.")[i % 3], lw=1, label=limit.label)
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    kinds = {b.ours for b in panel.bars}
    handles += [Patch(color=OURS, label="weightlift")] if True in kinds else []
    handles += [Patch(color=PEER, label=panel.peers)] if False in kinds else []
    top = max([*values, *(lim.value for lim in panel.limits)], default=1.0) or 1.0
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(x, [b.label for b in panel.bars], rotation=20, ha="right", size=8)
    ax.set_ylabel(panel.unit)
    ax.set_title(panel.title, size=10)
    ax.legend(handles=handles, fontsize=8, loc="upper right")


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path
