"""The benches' results (their `--json` documents) as bar-chart panels: ours against the peers
and the machine's limits measured in the same run. Drawing is local/plot.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightlift.local.plot import Bar, Limit, Panel, bar_chart, save

Doc = dict[str, Any]


def _ratio(value: float, of: float | None, name: str) -> str:
    return f"{value / of:.2f}x {name}" if of else ""


def load_panels(doc: Doc) -> list[Panel]:
    """`bench load`: warm and cold page cache, every loader, against memcpy / O_DIRECT read."""
    limits = doc["limits"]
    panels = []
    for cache, limit, short in (
        ("warm", Limit("memcpy (threads)", limits["memcpy_gbps"]), "memcpy"),
        ("cold", Limit("O_DIRECT read", limits.get("odirect_read_gbps") or 0.0), "O_DIRECT"),
    ):
        rows = [r for r in doc["results"] if r["cache"] == cache]
        peers = [r["gbps"] for r in rows if not r["loader"].startswith("weightlift")]
        best = max(peers, default=None)
        bars = []
        for r in rows:
            ours = r["loader"].startswith("weightlift")
            notes = [_ratio(r["gbps"], limit.value, short)]
            if ours:
                notes.append(_ratio(r["gbps"], best, "best peer"))
            bars.append(Bar(r["loader"], r["gbps"], ours, "\n".join(n for n in notes if n)))
        panels.append(Panel(f"{cache} page cache", "GB/s", bars, [limit] if limit.value else []))
    return panels


def remote_panels(doc: Doc) -> list[Panel]:
    """`bench load --uri s3://|hf://`: every contender against the store's raw ranged GETs."""
    limits = [
        Limit(k.removesuffix("_gbps").replace("_", " "), v)
        for k, v in doc["limits"].items()
        if k != "memcpy_gbps" and v  # memcpy dwarfs a network store's rates
    ]
    ceiling = limits[0] if limits else None
    best = max(
        (r["gbps"] for r in doc["results"] if not r["loader"].startswith("weightlift")),
        default=None,
    )
    bars = []
    for r in doc["results"]:
        ours = r["loader"].startswith("weightlift")
        notes = [_ratio(r["gbps"], ceiling.value if ceiling else None, "raw GETs")]
        if ours:
            notes.append(_ratio(r["gbps"], best, "best peer"))
        bars.append(Bar(r["loader"], r["gbps"], ours, "\n".join(n for n in notes if n)))
    return [Panel(f"cold start from {doc.get('uri', 'the store')}", "GB/s", bars, limits)]


def p2p_panels(doc: Doc) -> list[Panel]:
    """`bench p2p`: pulls against storage reloads and memcpy; time to Ready where measured."""
    fresh = doc["limits"]["memcpy_fresh_gbps"]
    rows: list[tuple[str, Doc | None, bool]] = [
        ("P2P pull", doc["p2p"], True),
        ("P2P into standby", doc.get("p2p_standby"), True),
        ("storage cold, in a worker", doc.get("storage_worker"), False),
        ("storage cold", doc["storage"], False),
        ("storage warm", doc["storage_warm"], False),
    ]
    bars = [
        Bar(label, r["gbps"], ours, _ratio(r["gbps"], fresh, "new memory"))
        for label, r, ours in rows
        if r
    ]
    limits = [
        Limit("memcpy", doc["limits"]["memcpy_gbps"]),
        Limit("memcpy into new memory", fresh),
    ]
    panels = [Panel("load GB/s, 2 ranks", "GB/s", bars, limits, peers="storage")]
    ready = doc["p2p"].get("ready_seconds")
    storage_ready = (doc.get("storage_worker") or {}).get("ready_seconds")
    if ready and storage_ready:
        panels.append(
            Panel(
                "time to Ready (lower is better)",
                "seconds",
                [
                    Bar("P2P target", ready, True, _ratio(storage_ready, ready, "storage's speed")),
                    Bar("storage source", storage_ready, False),
                ],
                peers="storage",
            )
        )
    return panels


def vllm_panels(doc: Doc, base: str = "auto") -> list[Panel]:
    """`bench vllm` (`bench triton`: base "triton-auto"): seconds to ready and load GB/s,
    weightlift's paths against vLLM's own loader."""
    rows: dict[str, Doc] = doc["rows"]
    first = rows[base]["ready_s"]
    ready = [
        Bar(name, r["ready_s"], name != base, _ratio(first, r["ready_s"], f"{base}'s speed"))
        for name, r in rows.items()
    ]
    panels = [Panel("start to ready (lower is better)", "seconds", ready, peers=base)]
    load = [Bar(n, r["gbps"], n != base) for n, r in rows.items() if r.get("gbps")]
    if load:
        panels.append(Panel("weight load", "GB/s", load, peers=base))
    return panels


def operator_panels(ours: Doc, floor: Doc) -> list[Panel]:
    """`bench operator` against `--floor` (the control plane alone, no operator, same machine):
    when each share of the deployments was Ready, and API requests per deployment."""
    mine, theirs = ours["milestones_seconds"], floor["milestones_seconds"]
    bars = []
    for key, share in (("p50", "50%"), ("p90", "90%"), ("all", "all")):
        a, b = mine["deployments_ready"].get(key), theirs["deployments_ready"].get(key)
        if a is not None and b is not None:
            bars += [
                Bar(f"operator, {share}", a, True, _ratio(a, b, "floor")),
                Bar(f"floor, {share}", b, False),
            ]
    n = f"{ours['deployments']} x {ours['replicas']}"
    peers = "floor: no operator"
    panels = [Panel(f"deployments Ready ({n}), lower is better", "seconds", bars, peers=peers)]
    per = [d.get("api_requests", {}).get("ramp_per_deployment") for d in (ours, floor)]
    if per[0] and per[1]:
        calls = [
            Bar("operator", per[0], True, _ratio(per[0], per[1], "floor")),
            Bar("floor", per[1], False),
        ]
        panels.append(Panel("API requests per deployment", "requests", calls, peers=peers))
    return panels


def plot(panels: list[Panel], title: str, path: Path) -> Path:
    return save(bar_chart(panels, title), path)
