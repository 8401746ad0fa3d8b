"""What `bench operator` and its `--floor` both measure with: the ModelDeployments they create,
the milestones their watches record, and the machine's load. Below both, so neither imports the
other's command."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightlift.api.labels import DEPLOYMENT_LABEL, ROLE_LABEL
from weightlift.api.model import GROUP, VERSION
from weightlift.bench import simworkers
from weightlift.bench.operator_stack import NAMESPACE

PHASES = (
    "first pod created [operator]",
    "first pod scheduled [scheduler]",
    "first pod Ready in kwok [kwok]",
    "first Ready -> others created [operator]",
    "other pods scheduled [scheduler]",
    "other pods Ready in kwok [kwok]",
    "all pods Ready -> deployment Ready [operator]",
)


@dataclass
class Timeline:
    """When (unix seconds) each object first reached a milestone, as the bench's watches saw."""

    md_created: dict[str, float] = field(default_factory=dict)
    md_ready: dict[str, float] = field(default_factory=dict)
    pod_seen: dict[str, float] = field(default_factory=dict)
    pod_scheduled: dict[str, float] = field(default_factory=dict)
    pod_ready: dict[str, float] = field(default_factory=dict)
    pod_owner: dict[str, tuple[str, str]] = field(default_factory=dict)  # -> (deployment, role)

    def on_md(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        if (obj.get("status") or {}).get("phase") == "Ready":
            self.md_ready.setdefault(obj["metadata"]["name"], time.time())

    def on_pod(self, event: dict[str, Any]) -> None:
        obj, now = event["object"], time.time()
        name = obj["metadata"]["name"]
        self.pod_seen.setdefault(name, now)
        labels = obj["metadata"].get("labels") or {}
        if name not in self.pod_owner and DEPLOYMENT_LABEL in labels:
            self.pod_owner[name] = (labels[DEPLOYMENT_LABEL], labels.get(ROLE_LABEL, ""))
        if (obj.get("spec") or {}).get("nodeName"):
            self.pod_scheduled.setdefault(name, now)
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            self.pod_ready.setdefault(name, now)

    def phases(self) -> dict[str, list[float]]:
        """Per deployment, the seconds each step of its way to Ready took, and who owns the
        step: [operator] steps are the operator's reaction (from what it saw to what it wrote);
        [scheduler] and [kwok] steps belong to the control plane (kwok plays the kubelets).
        A step missing for a deployment (not reached in time) is left out."""
        pods: dict[str, list[str]] = {}
        for pod, (deployment, _role) in self.pod_owner.items():
            pods.setdefault(deployment, []).append(pod)
        steps: dict[str, list[float]] = {key: [] for key in PHASES}
        for deployment, created in self.md_created.items():
            mine = sorted(pods.get(deployment, []), key=lambda p: self.pod_seen[p])
            if not mine:
                continue
            first = mine[0]  # the source: created first, alone
            later = mine[1:]
            self._step(steps, "first pod created [operator]", created, self.pod_seen.get(first))
            self._pod_steps(steps, "first pod", [first])
            if later:
                first_ready = self.pod_ready.get(first)
                rest_seen = max(self.pod_seen[p] for p in later)
                self._step(
                    steps, "first Ready -> others created [operator]", first_ready, rest_seen
                )
                self._pod_steps(steps, "other pods", later)
            if all(p in self.pod_ready for p in mine):
                last_ready = max(self.pod_ready[p] for p in mine)
                ready = self.md_ready.get(deployment)
                self._step(
                    steps, "all pods Ready -> deployment Ready [operator]", last_ready, ready
                )
        return steps

    def _pod_steps(self, steps: dict[str, list[float]], label: str, pods: list[str]) -> None:
        """created -> scheduled -> Ready of a group of pods: its slowest pod's."""
        for start, end, owner in (
            (self.pod_seen, self.pod_scheduled, "scheduled [scheduler]"),
            (self.pod_scheduled, self.pod_ready, "Ready in kwok [kwok]"),
        ):
            lags = [end[p] - start[p] for p in pods if p in start and p in end]
            if len(lags) == len(pods):
                steps[f"{label} {owner}"].append(max(lags))

    @staticmethod
    def _step(
        steps: dict[str, list[float]], key: str, start: float | None, end: float | None
    ) -> None:
        if start is not None and end is not None:
            steps[key].append(max(0.0, end - start))


def manifest(index: int, replicas: int, tensor: int, port: int, period: int) -> dict[str, Any]:
    """One ModelDeployment; each has its own model (identity), so each loads a source first
    and its other replicas pull from it: the two-step path every new model takes."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDeployment",
        "metadata": {"name": f"bench-{index:05d}", "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": f"file:///models/bench-{index:05d}", "name": "sim"},
            "replicas": replicas,
            "parallelism": {"tensor": tensor},
            "runtime": {"port": port},
            "probe": {
                "request": simworkers.probe_request(),
                "expectedOutputs": simworkers.expected_outputs(),
                "periodSeconds": period,
            },
        },
    }


def quantiles(times: dict[str, float], start: float, total: int) -> dict[str, float | None]:
    """Seconds after `start` at which 50%, 90% and 100% of `total` objects got there."""
    ordered = sorted(t - start for t in times.values())
    out: dict[str, float | None] = {}
    for label, frac in (("p50", 0.5), ("p90", 0.9), ("all", 1.0)):
        need = max(1, round(frac * total))
        out[label] = round(ordered[need - 1], 2) if len(ordered) >= need else None
    return out


class MachineLoad:
    """Busy share of all CPUs between two reads of /proc/stat (everyone on the machine)."""

    def __init__(self) -> None:
        self.last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = values[3] + values[4]
        return sum(values) - idle, sum(values)

    def busy(self) -> float:
        busy, total = self._read()
        share = (busy - self.last[0]) / max(1, total - self.last[1])
        self.last = (busy, total)
        return round(share * (os.cpu_count() or 1), 2)  # in cores
