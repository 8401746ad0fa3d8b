"""`weightlift bench scale-out`: N replicas of one model from zero, on the local stack.

Prints the time until every replica is Ready, who pulled from whom (the fan-out tree the
sources built), and the ratio of that time to a doubling fan-out's ideal,
t_source + log2(N) x t_pull: one source loads from storage, then every Ready replica feeds
another each round. The builtin runtime keeps the engine out of the figure; the model is large
enough that a pull shows (256 MB by default).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

JSON = dict[str, Any]
NAME = "scaleout"


def _ready_at(replica: JSON) -> float | None:
    """Seconds from the apply to this replica's Ready (from its pod's creation when the apply
    time is unknown)."""
    value = replica.get("readyAt", replica.get("secondsToReady"))
    return float(value) if value is not None else None


@dataclass(frozen=True)
class FanOut:
    """What one scale-out did: per replica where its weights came from and when it was Ready."""

    replicas: list[JSON]
    seconds_to_all_ready: float

    @property
    def source(self) -> JSON | None:
        """The replica that loaded from storage first (the fan-out's root)."""
        stored = [
            r for r in self.replicas if not str(r.get("loadedFrom") or "").startswith("peer:")
        ]
        timed = [r for r in stored if _ready_at(r) is not None]
        return min(timed, key=lambda r: float(_ready_at(r) or 0.0)) if timed else None

    def pull_seconds(self) -> list[float]:
        return [
            float(r["loadSeconds"])
            for r in self.replicas
            if str(r.get("loadedFrom") or "").startswith("peer:") and r.get("loadSeconds")
        ]

    def depth(self, name: str, seen: frozenset[str] = frozenset()) -> int:
        """Hops from storage: 0 for a storage load, 1 + the feeder's depth for a pull."""
        by_name = {r["name"]: r for r in self.replicas}
        origin = str(by_name.get(name, {}).get("loadedFrom") or "")
        feeder = origin.removeprefix("peer:")
        if not origin.startswith("peer:") or feeder in seen or feeder not in by_name:
            return 0
        return 1 + self.depth(feeder, seen | {name})

    def ideal_seconds(self) -> float | None:
        """t_source + log2(N) x t_pull (median pull), None without a source or a pull."""
        src, pulls = self.source, self.pull_seconds()
        if src is None or not pulls:
            return None
        n = len(self.replicas)
        return float(_ready_at(src) or 0.0) + math.log2(max(n, 1)) * statistics.median(pulls)

    def to_json(self) -> JSON:
        ideal = self.ideal_seconds()
        pulls = self.pull_seconds()
        src = self.source
        return {
            "replicas": len(self.replicas),
            "secondsToAllReady": self.seconds_to_all_ready,
            "sourceSecondsToReady": _ready_at(src) if src else None,
            "medianPullSeconds": round(statistics.median(pulls), 3) if pulls else None,
            "idealSeconds": round(ideal, 3) if ideal else None,
            "ratioToIdeal": round(self.seconds_to_all_ready / ideal, 3) if ideal else None,
            "maxDepth": max((self.depth(r["name"]) for r in self.replicas), default=0),
            "pulledFrom": {r["name"]: r.get("loadedFrom") for r in self.replicas},
            "perReplica": self.replicas,
        }


def run_scale_out(
    replicas: int, size_mb: float, timeout: float, state_dir: Path, log: Any = print
) -> FanOut:
    model_dir = state_dir / "model"
    log(f"making a {size_mb:.0f} MB demo model")
    probe = make_demo_model(model_dir, size_mb)
    # One GPU a replica: the process node advertises as many as the scale-out needs.
    stack = LocalStack(
        state_dir / "stack", model_path_prefixes=(str(model_dir),), gpus=max(8, replicas)
    )
    with stack:
        log("local stack up; applying the ModelDeployment")
        manifest = model_deployment(NAME, model_dir, replicas=replicas, probe=probe)
        obs = Observer(stack, NAME)
        stack.apply(manifest)
        obs.wait_ready(timeout)
        summary = obs.summary()
    for r in summary["replicas"]:  # seconds since the apply (the demo's --json has them too)
        seen = obs.times.get(r["name"])
        if seen is not None:
            r.setdefault("createdAt", round(seen.first_seen - obs.started, 3))
            if seen.ready_at is not None:
                r.setdefault("readyAt", round(seen.ready_at - obs.started, 3))
    return FanOut(replicas=summary["replicas"], seconds_to_all_ready=summary["secondsToReady"])


def print_report(fan: FanOut) -> None:
    from rich.console import Console
    from rich.table import Table

    doc = fan.to_json()
    table = Table(title=f"scale-out of {doc['replicas']} replicas (times: s since the apply)")
    columns = ("replica", "loaded from", "hops", "load s", "GB/s", "created", "Ready")
    for col in columns:
        table.add_column(col)
    prefix = str(fan.replicas[0]["name"]).rsplit("-", 1)[0] + "-" if fan.replicas else ""

    def short(text: object) -> str:
        return str(text).replace(prefix, "")

    def secs(value: object, digits: int = 1) -> str:
        return f"{float(value):.{digits}f}" if isinstance(value, int | float) else "-"

    for r in sorted(fan.replicas, key=lambda r: r.get("readyAt") or 0.0):
        table.add_row(
            short(r["name"]),
            short(r.get("loadedFrom")),
            str(fan.depth(r["name"])),
            secs(r.get("loadSeconds"), 2),
            secs(r.get("gbps"), 2),
            secs(r.get("createdAt")),
            secs(r.get("readyAt")),
        )
    console = Console()
    console.print(table)
    console.print(
        f"all Ready after {doc['secondsToAllReady']:.1f} s; source Ready after "
        f"{doc['sourceSecondsToReady']} s; median pull {doc['medianPullSeconds']} s; "
        f"ideal t_source + log2(N) x t_pull = {doc['idealSeconds']} s; "
        f"ratio {doc['ratioToIdeal']}; deepest fan-out {doc['maxDepth']} hops"
    )


@click.command("scale-out")
@click.option("--replicas", type=click.IntRange(2, 64), default=16, show_default=True)
@click.option("--size-mb", type=float, default=256.0, show_default=True)
@click.option("--timeout", type=float, default=900.0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def scale_out_command(replicas: int, size_mb: float, timeout: float, json_out: Path | None) -> None:
    """N builtin-runtime replicas from zero: time to all Ready, the fan-out tree, vs ideal."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wl-scaleout-") as tmp:
        fan = run_scale_out(replicas, size_mb, timeout, Path(tmp), log=click.echo)
    print_report(fan)
    click.echo(f"(bench wall time {time.monotonic() - started:.0f} s)")
    if json_out is not None:
        json_out.write_text(json.dumps(fan.to_json(), indent=2) + "\n")
        click.echo(f"wrote {json_out}")
