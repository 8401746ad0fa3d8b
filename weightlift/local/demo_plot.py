"""`weightlift demo --plot`: the summary's "where each replica's seconds went" as a Gantt chart.

Drawn from the same `timeline` (observe.replica_timeline, TIMELINE_STEPS) that the table
prints, each row starting when the demo first saw its pod (`createdAt`, since the apply)."""

from __future__ import annotations

from pathlib import Path

from weightlift.local.kube import JSON
from weightlift.local.observe import TIMELINE_STEPS
from weightlift.local.plot import Lane, gantt, save

PHASES = tuple(step for step, _ in TIMELINE_STEPS)
XLABEL = "seconds since the apply (a row starts when the demo saw its pod)"


def timeline_lanes(summary: JSON) -> list[Lane]:
    """One lane per replica of a demo summary (`--json`), its steps in PHASES order."""
    lanes = []
    for r in summary["replicas"]:
        steps = r.get("timeline") or {}
        source = str(r.get("loadedFrom") or "-")
        lanes.append(
            Lane(
                name=f"{r['name']}\n{r.get('role') or '-'} ← {source}",
                start=float(r.get("createdAt") or 0.0),
                steps=[(p, float(steps[p])) for p in PHASES if p in steps],
            )
        )
    return lanes


def plot_demo(summary: JSON, path: Path, name: str = "demo") -> Path:
    ready = summary.get("secondsToReady")
    title = f"weightlift demo {name}: where each replica's seconds went"
    if ready is not None:
        title += f", all Ready in {ready:.1f} s"
    return save(gantt(timeline_lanes(summary), PHASES, title, XLABEL), path)
