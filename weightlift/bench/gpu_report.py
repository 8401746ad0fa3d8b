"""`bench gpu`'s ratios, goals and tables. The goals are issue 44's, judged only on CUDA: each
figure against a limit measured in the same run, never against a number from elsewhere."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from weightlift.bench.gpu_loaders import OURS, best_peer

JSON = dict[str, Any]
P2P_GBPS = 50.0
CHECKSUM_GBPS = 500.0
WARM_X_H2D = 0.9
FIRST_X_H2D = 0.8
COLD_X_ODIRECT = 1.0
PRELOAD = "weightlift-preload"


def add_ratios(doc: JSON) -> None:
    """Every loader's warm and first-in-process GB/s over pinned H2D, cold over O_DIRECT."""
    limits = doc.get("limits", {})
    h2d = limits.get("h2d_pinned", {}).get("gbps")
    odirect = limits.get("odirect_read_gbps")
    for r in doc.get("loaders", {}).get("results", {}).values():
        if h2d and "warm" in r:
            r["warm"]["x_h2d_pinned"] = round(r["warm"]["gbps"] / h2d, 3)
        if odirect and "cold" in r:
            r["cold"]["x_odirect"] = round(r["cold"]["gbps"] / odirect, 3)
    for r in doc.get("first_in_process", {}).values():
        if h2d and "gbps" in r:
            r["x_h2d_pinned"] = round(r["gbps"] / h2d, 3)


def _goal(name: str, value: float | None, target: str, passed: bool | None, note: str = "") -> JSON:
    return {"goal": name, "value": value, "target": target, "passed": passed, "note": note}


def goals(doc: JSON) -> list[JSON]:
    """Pass/fail against the issue's targets; None where the run could not measure it."""
    out: list[JSON] = []
    p2p = doc.get("p2p", {})
    named = [p2p.get("transport", ""), *p2p.get("ucx_read_transports", [])]
    cuda_ipc = any("cuda_ipc" in str(t) for t in named)
    gbps = p2p.get("gbps")
    out.append(
        _goal(
            "P2P VRAM to VRAM, end to end (verification included), cuda_ipc named",
            gbps,
            f">= {P2P_GBPS:g} GB/s and cuda_ipc",
            None if gbps is None else bool(gbps >= P2P_GBPS and cuda_ipc and p2p.get("verified")),
            f"transport {', '.join(str(t) for t in named if t) or 'unknown'}",
        )
    )
    dev = doc.get("checksums", {}).get("kinds", {}).get("dev64", {})
    agree = doc.get("checksums", {}).get("agreement", {}).get("equal")
    out.append(
        _goal(
            "device checksum dev64 (kernel equal to the CPU reference)",
            dev.get("gbps"),
            f">= {CHECKSUM_GBPS:g} GB/s",
            None if "gbps" not in dev else bool(dev["gbps"] >= CHECKSUM_GBPS and agree),
            dev.get("skipped", "") or f"kernel == CPU: {agree}",
        )
    )
    limits = doc.get("limits", {})
    h2d = limits.get("h2d_pinned", {}).get("gbps")
    odirect = limits.get("odirect_read_gbps")
    ours = doc.get("loaders", {}).get("results", {}).get(PRELOAD, {})
    warm = ours.get("warm", {}).get("gbps")
    out.append(_ratio_goal("preload warm", warm, h2d, WARM_X_H2D, "pinned H2D"))
    first = doc.get("first_in_process", {}).get(PRELOAD, {}).get("gbps")
    out.append(_ratio_goal("preload first in a fresh process", first, h2d, FIRST_X_H2D, "H2D"))
    cold = ours.get("cold", {}).get("gbps")
    out.append(_ratio_goal("preload cold", cold, odirect, COLD_X_ODIRECT, "O_DIRECT"))
    peer = best_peer(doc.get("loaders", {}).get("results", {}), "cold")
    out.append(
        _goal(
            "preload cold against the best peer",
            cold,
            f">= {peer[0]} ({peer[1]:.2f} GB/s)" if peer else ">= best peer",
            None if cold is None or peer is None else cold >= peer[1],
            doc.get("loaders", {}).get("cold_drop", {}).get("note", ""),
        )
    )
    life = doc.get("lifecycle", {})
    out.append(
        _goal(
            "worker lifecycle on the GPU (hook index, probe, target same answers)",
            None,
            "passes",
            life.get("passed"),
        )
    )
    return out


def _ratio_goal(
    name: str, value: float | None, limit: float | None, factor: float, what: str
) -> JSON:
    if value is None or not limit:
        return _goal(name, value, f">= {factor:g}x {what}", None, "not measured")
    ratio = value / limit
    return _goal(
        name,
        value,
        f">= {factor:g}x {what} ({factor * limit:.2f} GB/s)",
        ratio >= factor,
        f"{ratio:.2f}x",
    )


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_report(doc: JSON) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 120)
    host = doc["host"]
    console.print(f"[bold]weightlift bench gpu[/bold]: {host['device_name']}, {host['summary']}")
    if doc.get("note"):
        console.print(doc["note"])
    lim = doc.get("limits", {})
    t = Table(title=escape("limits (GB/s, median [min-max])"))
    for col in ("what", "GB/s", "spread"):
        t.add_column(col)
    for key, label in (
        ("h2d_pinned", "pinned host -> device"),
        ("h2d_pageable", "pageable host -> device"),
        ("d2d", "device -> device (bytes counted once)"),
    ):
        if key in lim:
            r = lim[key]
            t.add_row(label, _f(r["gbps"]), f"{r['min_gbps']:.2f}-{r['max_gbps']:.2f}")
    t.add_row("O_DIRECT read of the model files", _f(lim.get("odirect_read_gbps")), "")
    t.add_row("host memcpy (all cores)", _f(lim.get("memcpy_gbps")), "")
    console.print(t)
    _print_loaders(console, doc, Table)
    _print_p2p(console, doc, Table)
    _print_checksums(console, doc, Table)
    life = doc.get("lifecycle")
    if life:
        console.print(f"worker lifecycle on {life['device']}: passed={life.get('passed')}")
        for role in ("source", "target"):
            r = life.get(role, {})
            keys = ("phase", "hook_ok", "probe_ok", "from_peer", "same_answers", "gpu_memory_mib")
            console.print(f"  {role}: " + ", ".join(f"{k}={r[k]}" for k in keys if k in r))
            if "skipped" in r:
                console.print(f"  {role}: skipped: {r['skipped']}")
    if doc.get("goals"):
        g = Table(title="goals (issue 44)")
        for col in ("goal", "value", "target", "pass", "note"):
            g.add_column(col)
        for row in doc["goals"]:
            mark = {True: "PASS", False: "FAIL", None: "n/a"}[row["passed"]]
            g.add_row(row["goal"], _f(row["value"]), row["target"], mark, row["note"])
        console.print(g)


def _print_loaders(console: Any, doc: JSON, table: Any) -> None:
    loaders = doc.get("loaders", {}).get("results", {})
    first = doc.get("first_in_process", {})
    if not loaders and not first:
        return
    title = f"loaders into {doc['device']} (GB/s, median of {doc['repeat']} [min-max])"
    t = table(title=escape(title))
    for col in ("loader", "warm", "x H2D", "cold", "x O_DIRECT", "first in process", "x H2D"):
        t.add_column(col)
    for name in dict.fromkeys([*loaders, *first]):
        r, f = loaders.get(name, {}), first.get(name, {})
        why = r.get("skipped") or r.get("error")
        if why:
            t.add_row(name, why, "", "", "", "", "")
            continue
        warm, cold = r.get("warm", {}), r.get("cold", {})
        t.add_row(
            name + ("" if name not in OURS else " (ours)"),
            _cell(warm),
            _f(warm.get("x_h2d_pinned")),
            _cell(cold),
            _f(cold.get("x_odirect")),
            _cell(f) if "gbps" in f else f.get("error", "-")[:40],
            _f(f.get("x_h2d_pinned")),
        )
    console.print(t)
    console.print(doc.get("loaders", {}).get("cold_drop", {}).get("note", ""))


def _cell(r: JSON) -> str:
    if "gbps" not in r:
        return "-"
    bad = "" if r.get("verified", True) else " NOT bit-equal"
    return escape(f"{r['gbps']:.2f} [{r['min_gbps']:.2f}-{r['max_gbps']:.2f}]{bad}")


def _print_p2p(console: Any, doc: JSON, table: Any) -> None:
    p = doc.get("p2p")
    if not p:
        return
    if "skipped" in p or "error" in p:
        console.print(f"P2P: {p.get('skipped') or p.get('error')}")
        return
    t = table(title=f"P2P, two processes, {doc['device']} to {doc['device']}")
    for col in ("GB/s (median [min-max])", "first pull s", "verified", "phases s", "transport"):
        t.add_column(escape(col))
    phases = ", ".join(f"{k} {v:.4f}" for k, v in p["phases"].items())
    ucx = ", ".join(p["ucx_read_transports"]) or "-"
    t.add_row(
        _cell(p),
        f"{p['first_pull_seconds']:.3f}",
        str(p["verified"]),
        phases,
        f"pull: {p['transport']}; UCX_PROTO_INFO: {ucx}",
    )
    console.print(t)


def _print_checksums(console: Any, doc: JSON, table: Any) -> None:
    c = doc.get("checksums")
    if not c:
        return
    t = table(title=f"checksums of a tensor on {c['device']} (GB/s)")
    for col in ("kind", "GB/s", "note"):
        t.add_column(col)
    for kind, r in c["kinds"].items():
        t.add_row(kind, _cell(r) if "gbps" in r else "-", r.get("skipped") or r.get("error", ""))
    console.print(t)
    if "agreement" in c:
        console.print(f"dev64 device == CPU reference: {c['agreement']}")
