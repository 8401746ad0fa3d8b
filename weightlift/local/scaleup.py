"""Scale-ups on the local stack, measured as an autoscaler lives them: the scale subresource is
patched (what `kubectl scale` and an HPA do) and the clock runs until the new replica is Ready.

Two kinds: `spare` (spec.warmSpares keeps a pod waiting in Standby; the scale-up hands it its
peers) and `cold` (no spare: the operator creates a pod that starts from nothing). The demo
(`weightlift demo --scale-up`) runs one of each on the same deployment."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from weightlift.local.kube import JSON
from weightlift.local.observe import Observer


@dataclass(frozen=True)
class ScaleUp:
    kind: str  # "spare" | "cold"
    from_replicas: int
    to_replicas: int
    ready_s: float  # from the scale patch to the new replica's Ready in status
    replica: str
    uid: str
    was_spare: bool  # the Ready pod is the very pod that waited as a spare (same UID)
    role: str
    loaded_from: str

    def as_json(self) -> JSON:
        return asdict(self)


def spare_rows(obs: Observer) -> list[JSON]:
    return [r for r in obs.replica_statuses() if r.get("spare")]


def serving_ready(obs: Observer) -> dict[str, JSON]:
    return {r["name"]: r for r in obs.replica_statuses() if r.get("ready") and not r.get("spare")}


def _uid(obs: Observer, pod_name: str) -> str:
    for pod in obs.pods:
        if pod["metadata"]["name"] == pod_name:
            return str(pod["metadata"]["uid"])
    return ""


def wait_spares(obs: Observer, count: int, timeout: float) -> None:
    """Until exactly `count` spares wait, each warm (phase Spare: handed nothing, its hooks
    run, its worker in Standby), and no other spare pod is left over."""

    def settled(o: Observer) -> bool:
        rows = spare_rows(o)
        return (
            o.status().get("spares") == count
            and len(rows) == count
            and all(r.get("phase") == "Spare" and r.get("hooksRun") for r in rows)
        )

    obs.wait(settled, timeout, f"{count} warm spare(s) in Standby")


def set_warm_spares(obs: Observer, count: int, timeout: float) -> None:
    obs.stack.patch_md(obs.name, {"spec": {"warmSpares": count}})
    wait_spares(obs, count, timeout)


def scale_up(obs: Observer, to: int, kind: str, timeout: float) -> ScaleUp:
    """Patch the scale subresource to `to` and time the new replica to Ready."""
    obs.poll()
    before = serving_ready(obs)
    spares = {r["name"]: _uid(obs, r["name"]) for r in spare_rows(obs)}
    started = time.monotonic()
    obs.stack.scale_md(obs.name, to)
    obs.wait(
        lambda o: len(serving_ready(o)) >= to,
        timeout,
        f"{obs.name}: {to} Ready replicas after the scale-up",
        interval=0.1,
    )
    ready_s = time.monotonic() - started
    new = [row for name, row in serving_ready(obs).items() if name not in before]
    if len(new) != 1:
        names = [r["name"] for r in new]
        raise RuntimeError(f"{obs.name}: expected one new Ready replica, got {names}")
    row = new[0]
    uid = _uid(obs, row["name"])
    return ScaleUp(
        kind=kind,
        from_replicas=len(before),
        to_replicas=to,
        ready_s=round(ready_s, 3),
        replica=row["name"],
        uid=uid,
        was_spare=spares.get(row["name"]) == uid != "",
        role=str(row.get("role")),
        loaded_from=str(row.get("loadedFrom")),
    )


def spare_then_cold(obs: Observer, replicas: int, timeout: float) -> list[ScaleUp]:
    """On a Ready deployment with one warm spare: a scale-up the spare serves, then (spares
    set to 0) a cold one. Returns both, spare first."""
    wait_spares(obs, 1, timeout)
    spare = scale_up(obs, replicas + 1, "spare", timeout)
    set_warm_spares(obs, 0, timeout)
    cold = scale_up(obs, replicas + 2, "cold", timeout)
    return [spare, cold]
