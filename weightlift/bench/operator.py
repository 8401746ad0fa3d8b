"""`weightlift bench operator`: N ModelDeployments x R replicas against the real operator.

A real control plane (etcd, kube-apiserver, scheduler, controller-manager) with kwok GPU nodes;
kwok makes the bound pods Running/Ready with loopback pod IPs, where one simulated-workers
process (simworkers.py) answers the worker's status and KServe v2 inference, so the operator's
real probes run. The operator is `weightlift operator` as a subprocess under its own
ServiceAccount; the API server's audit log counts its requests.

Reported: seconds from the first create to every ModelDeployment Ready (with milestones:
pods created, pods Ready in kwok, deployments Ready), the operator's API requests (during the
ramp, and per second in the steady state after), its CPU seconds and peak RSS, and the
simulated workers' request rates. `--profile py-spy|cprofile` adds the operator's hottest
functions. Other processes on the machine share its cores: the machine's load is printed too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.bench import apiaudit, memtrace
from weightlift.bench.operator_floor import floor_requests, render_floor, run_floor
from weightlift.bench.operator_measure import MachineLoad, Timeline, manifest, quantiles
from weightlift.bench.operator_profile import top_functions
from weightlift.bench.operator_stack import NAMESPACE, PROFILERS, BenchStack, ProcessMeter
from weightlift.bench.watch import AsyncKube

TARGET_SECONDS = 60.0
TARGET_RSS_MB = 200.0


def spread(values: list[float]) -> dict[str, float | None]:
    """Median, 90th percentile and maximum of per-object seconds."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p90": None, "max": None}

    def at(frac: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(frac * len(ordered)))], 2)

    return {"p50": at(0.5), "p90": at(0.9), "max": round(ordered[-1], 2)}


async def run_bench(
    stack: BenchStack,
    deployments: int,
    replicas: int,
    tensor: int,
    period: int,
    steady_seconds: float,
    timeout: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    timeline = Timeline()
    meter = ProcessMeter(stack.operator_pid)
    sim_meter = ProcessMeter(stack.sim_pid)
    md_path = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    async with AsyncKube(stack.info.kubeconfig) as kube:
        stop = asyncio.Event()
        watches = [
            asyncio.create_task(kube.follow(md_path, {}, timeline.on_md, stop)),
            asyncio.create_task(kube.follow(pod_path, {}, timeline.on_pod, stop)),
        ]
        await asyncio.sleep(0.5)  # both watches open before the first create
        load = MachineLoad()
        cpu0 = meter.cpu_seconds()
        components = {name: ProcessMeter(pid) for name, pid in stack.component_pids().items()}
        component_cpu0 = {name: m.cpu_seconds() for name, m in components.items()}
        start = time.time()
        port = stack.worker_port
        manifests = [manifest(i, replicas, tensor, port, period) for i in range(deployments)]
        await kube.create_all(md_path, manifests, timeline.md_created, concurrency=8)
        say(f"{deployments} ModelDeployments created in {time.time() - start:.1f}s")
        deadline = start + timeout
        while len(timeline.md_ready) < deployments and time.time() < deadline:
            if not stack.operator_alive():
                raise click.ClickException("the operator exited; see its log")
            await asyncio.sleep(0.5)
        ready_at = time.time()
        ramp_cpu = meter.cpu_seconds() - cpu0
        component_cpu = {
            name: round(m.cpu_seconds() - component_cpu0[name], 1) for name, m in components.items()
        }
        ramp_load = load.busy()
        say(
            f"{len(timeline.md_ready)}/{deployments} Ready after {ready_at - start:.1f}s; "
            f"steady state for {steady_seconds:.0f}s"
        )
        sim0, cpu1, sim_cpu1, steady_start = (
            stack.sim_stats(),
            meter.cpu_seconds(),
            sim_meter.cpu_seconds(),
            time.time(),
        )
        await asyncio.sleep(steady_seconds)
        steady_end = time.time()
        sim1 = stack.sim_stats()
        steady_cpu = meter.cpu_seconds() - cpu1
        sim_cpu = sim_meter.cpu_seconds() - sim_cpu1
        steady_load = load.busy()
        peak_rss, rss = meter.peak_rss_mb(), meter.rss_mb()
        stop.set()
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)

    return _result(
        stack,
        timeline,
        (deployments, replicas, tensor, period),
        Window(start, ready_at, steady_start, steady_end),
        {
            "ramp_cpu": ramp_cpu,
            "steady_cpu": steady_cpu,
            "sim_cpu": sim_cpu,
            "peak_rss": peak_rss,
            "rss": rss,
        },
        (sim0, sim1),
        {"component_cpu": component_cpu, "ramp_load": ramp_load, "steady_load": steady_load},
    )


@dataclass(frozen=True)
class Window:
    """The ramp (start to all Ready) and the steady state, in wall-clock seconds."""

    start: float
    ready_at: float
    steady_start: float
    steady_end: float


def _result(
    stack: BenchStack,
    timeline: Timeline,
    shape: tuple[int, int, int, int],
    w: Window,
    meters: dict[str, float],
    sims: tuple[dict[str, Any], dict[str, Any]],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The benchmark's JSON document from what the run measured."""
    deployments, replicas, tensor, period = shape
    start, ready_at = w.start, w.ready_at
    sim0, sim1 = sims
    all_ready = len(timeline.md_ready) == deployments
    requests = apiaudit.completed(stack.audit_log)
    ramp = apiaudit.in_window(requests, start, ready_at)
    steady = apiaudit.in_window(requests, w.steady_start, w.steady_end)
    steady_span = w.steady_end - w.steady_start

    def rates(counts: dict[str, int]) -> dict[str, float]:
        return {k: round(v / steady_span, 2) for k, v in sorted(counts.items())}

    sim_requests = {
        k: round((sim1["requests"].get(k, 0) - sim0["requests"].get(k, 0)) / steady_span, 1)
        for k in sim1["requests"]
    }
    total_pods = deployments * replicas
    return {
        "deployments": deployments,
        "replicas": replicas,
        "tensor_parallel": tensor,
        "probe_period_seconds": period,
        "kwok_nodes": len(stack.info.nodes),
        "all_ready": all_ready,
        "ready_deployments": len(timeline.md_ready),
        "seconds_to_all_ready": round(ready_at - start, 2) if all_ready else None,
        "milestones_seconds": {
            "deployments_created": quantiles(timeline.md_created, start, deployments),
            "pods_created": quantiles(timeline.pod_seen, start, total_pods),
            "pods_scheduled": quantiles(timeline.pod_scheduled, start, total_pods),
            "pods_ready_in_kwok": quantiles(timeline.pod_ready, start, total_pods),
            "deployments_ready": quantiles(timeline.md_ready, start, deployments),
        },
        "phases_seconds": {key: spread(v) for key, v in timeline.phases().items()},
        "ramp_cpu_seconds_by_process": dict(
            sorted(machine["component_cpu"].items(), key=lambda kv: -kv[1])
        ),
        "operator": {
            "ramp_cpu_seconds": round(meters["ramp_cpu"], 2),
            "ramp_cpu_cores": round(meters["ramp_cpu"] / max(0.01, ready_at - start), 2),
            "steady_cpu_cores": round(meters["steady_cpu"] / steady_span, 3),
            "peak_rss_mb": round(meters["peak_rss"], 1),
            "rss_mb_end": round(meters["rss"], 1),
        },
        "api_requests": {
            "ramp_total": len(ramp),
            "ramp_per_deployment": round(len(ramp) / deployments, 2),
            "ramp_by_kind": dict(sorted(apiaudit.by_kind(ramp).items())),
            "ramp_per_deployment_by_kind": {
                kind: round(n / deployments, 2)
                for kind, n in sorted(apiaudit.by_kind(ramp).items())
            },
            "floor_per_deployment_by_kind": floor_requests(replicas),
            "steady_per_second": round(len(steady) / steady_span, 2),
            "steady_per_second_by_kind": rates(apiaudit.by_kind(steady)),
            "errors": dict(apiaudit.by_kind([r for r in requests if r.code >= 400])),
        },
        "simulated_workers": {
            "steady_requests_per_second": sim_requests,
            "steady_cpu_cores": round(meters["sim_cpu"] / steady_span, 3),
            "pod_addresses": sim1["pod_addresses"],
        },
        "machine_busy_cores": {
            "ramp": machine["ramp_load"],
            "steady": machine["steady_load"],
            "of": os.cpu_count(),
        },
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def render(result: dict[str, Any], command: str) -> str:
    r, op, api = result, result["operator"], result["api_requests"]
    lines = [
        f"$ {command}",
        f"{r['deployments']} ModelDeployments x {r['replicas']} replicas "
        f"({r['deployments'] * r['replicas']} pods, tp {r['tensor_parallel']}) on "
        f"{r['kwok_nodes']} kwok nodes; probes every {r['probe_period_seconds']}s",
        "",
        f"{'seconds after the first create':<34}{'50%':>8}{'90%':>8}{'100%':>8}",
    ]
    for label, q in r["milestones_seconds"].items():
        cells = "".join(f"{'-' if v is None else v:>8}" for v in q.values())
        lines.append(f"{label.replace('_', ' '):<34}{cells}")
    lines += ["", f"{'per deployment, seconds of each step':<52}{'50%':>8}{'90%':>8}{'max':>8}"]
    for label, q in r["phases_seconds"].items():
        cells = "".join(f"{'-' if v is None else v:>8}" for v in q.values())
        lines.append(f"{label:<52}{cells}")
    lines += ["", "CPU seconds in the ramp by process (all share the machine's cores):"]
    lines += [f"  {name:<36}{cpu}" for name, cpu in r["ramp_cpu_seconds_by_process"].items()]
    ready = r["seconds_to_all_ready"]
    verdict = "not all Ready" if ready is None else f"{ready:.1f}s (target < {TARGET_SECONDS:.0f}s)"
    lines += [
        "",
        f"apply -> all Ready            {verdict}; "
        f"{r['ready_deployments']}/{r['deployments']} Ready",
        f"operator CPU, ramp            {op['ramp_cpu_seconds']} s ({op['ramp_cpu_cores']} cores)",
        f"operator CPU, steady          {op['steady_cpu_cores']} cores",
        f"operator peak RSS             {op['peak_rss_mb']} MB (target < {TARGET_RSS_MB:.0f} MB; "
        f"malloc settings: {op.get('malloc', '?')})",
        f"API requests, ramp            {api['ramp_total']} ({api['ramp_per_deployment']} per "
        f"deployment); errors in the run: {api['errors']}",
        f"API requests/s, steady        {api['steady_per_second']}",
    ]
    for kind, rate in api["steady_per_second_by_kind"].items():
        lines.append(f"  {kind:<36}{rate}/s")
    lines += requests_table(api)
    sim = r["simulated_workers"]
    lines += [
        f"simulated workers, steady     {sim['steady_requests_per_second']} req/s, "
        f"{sim['steady_cpu_cores']} cores, {sim['pod_addresses']} pod addresses seen",
        f"machine busy cores            ramp {r['machine_busy_cores']['ramp']}, steady "
        f"{r['machine_busy_cores']['steady']} of {r['machine_busy_cores']['of']} "
        "(everything on the machine: other work makes these numbers noisy)",
    ]
    if "profile_top" in r:
        lines += ["", "operator profile (self time, top functions):"]
        lines += [f"  {share:5.1f}%  {name}" for name, share in r["profile_top"]]
    if "memory_top_mb" in r:
        lines += ["", "operator heap at its largest (tracemalloc, MB):"]
        lines += [f"  {mb:7.2f}  {where}" for where, mb in r["memory_top_mb"]]
    return "\n".join(lines)


def plot_against_floor(result: dict[str, Any], floor_json: Path, png: Path) -> Path:
    from weightlift.bench.charts import operator_panels, plot

    if not floor_json.is_file():
        raise click.ClickException(f"no floor to draw against: run --floor first ({floor_json})")
    floor = json.loads(floor_json.read_text())
    title = "weightlift bench operator against --floor (the control plane alone, same machine)"
    return plot(operator_panels(result, floor), title, png)


def requests_table(api: dict[str, Any]) -> list[str]:
    """The ramp's API requests by kind: all of them, per deployment, and the floor's per
    deployment (operator_floor.floor_requests: what the floor sends in the operator's place)."""
    ours, floor = api["ramp_per_deployment_by_kind"], api["floor_per_deployment_by_kind"]
    lines = [f"API requests in the ramp by kind{'all':>13}{'per deployment':>16}{'floor':>8}"]
    for kind in sorted(ours.keys() | floor.keys()):
        count = api["ramp_by_kind"].get(kind, 0)
        lines.append(f"  {kind:<36}{count:>10}{ours.get(kind, 0):>16}{floor.get(kind, 0):>8}")
    total, floor_total = api["ramp_per_deployment"], sum(floor.values())
    lines.append(f"  {'total':<36}{api['ramp_total']:>10}{total:>16}{floor_total:>8}")
    return lines


@click.command("operator")
@click.option("--deployments", "-n", type=click.IntRange(1, 10000), default=100, show_default=True)
@click.option("--replicas", "-r", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--tensor-parallel", type=click.IntRange(1, 8), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(1, 256), default=32, show_default=True)
@click.option("--probe-period", type=click.IntRange(1, 3600), default=10, show_default=True)
@click.option("--steady-seconds", type=float, default=30.0, show_default=True)
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Ramp limit.")
@click.option("--profile", type=click.Choice(PROFILERS), default="none", show_default=True)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/bench-operator"),
    show_default=True,
)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--plot",
    "png",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw this run against the floor's (--floor-json) here (PNG).",
)
@click.option(
    "--floor-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The --floor run to draw against; default: the state dir's floor.json.",
)
@click.option(
    "--floor",
    is_flag=True,
    help="No operator: the bench creates the operator's pods itself and times the control "
    "plane alone (the floor under any operator on this machine).",
)
def operator_command(
    deployments: int,
    replicas: int,
    tensor_parallel: int,
    gpus_per_node: int,
    probe_period: int,
    steady_seconds: float,
    timeout: float,
    profile: str,
    state_dir: Path,
    json_out: Path | None,
    png: Path | None,
    floor_json: Path | None,
    floor: bool,
) -> None:
    """Time N ModelDeployments x R replicas to Ready against the real operator."""
    if tensor_parallel > gpus_per_node:
        raise click.BadParameter("larger than --gpus-per-node", param_hint="--tensor-parallel")
    command = shlex.join(["weightlift", *sys.argv[1:]])
    state_dir = state_dir.resolve()
    stack = BenchStack(
        state_dir,
        pods=deployments * replicas,
        gpus_per_pod=tensor_parallel,
        gpus_per_node=gpus_per_node,
        profiler=profile,
    )
    if floor:
        with stack:
            args = (stack, deployments, replicas, tensor_parallel, timeout, click.echo)
            floor_result = asyncio.run(run_floor(*args))
        floor_result["command"] = command
        out = json_out or state_dir / "floor.json"
        out.write_text(json.dumps(floor_result, indent=2) + "\n")
        click.echo(render_floor(floor_result, command))
        if not floor_result["all_ready"]:
            raise SystemExit(1)
        return
    with stack:
        click.echo(f"control plane up ({len(stack.info.nodes)} kwok nodes); starting the operator")
        stack.start_operator()
        result = asyncio.run(
            run_bench(
                stack,
                deployments,
                replicas,
                tensor_parallel,
                probe_period,
                steady_seconds,
                timeout,
                click.echo,
            )
        )
        stack.stop_operator()
    if profile == "tracemalloc":
        result["memory_top_mb"] = memtrace.summary(stack.profile_path)
        result["profile_file"] = str(stack.profile_path)
    elif profile != "none":
        result["profile_top"] = top_functions(stack.profile_path, profile)
        result["profile_file"] = str(stack.profile_path)
    result["command"] = command
    # The operator inherits the bench's environment: glibc's own variables win over its settings.
    tuned = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    result["operator"]["malloc"] = tuned or "the operator's own"
    out = json_out or state_dir / "result.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(render(result, command))
    click.echo(f"\nJSON: {out}; operator log: {state_dir / 'operator.log'}")
    if png is not None:
        click.echo(
            f"wrote {plot_against_floor(result, floor_json or state_dir / 'floor.json', png)}"
        )
    if not result["all_ready"]:
        raise SystemExit(1)
