"""`weightlift bench operator --floor`: the control plane alone, no operator.

The bench creates the very pods the operator would (the operator's own manifests, all at once,
without owner references) and times them to Ready in kwok: the floor under any operator on this
machine, and the CPU the API server, etcd, scheduler and kwok spend on that many pods.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from weightlift.api.model import ModelDeploymentSpec, Role
from weightlift.bench.operator import MachineLoad, Timeline, manifest, quantiles
from weightlift.bench.operator_stack import NAMESPACE, BenchStack, ProcessMeter
from weightlift.bench.watch import AsyncKube
from weightlift.operator.identity import model_identity
from weightlift.operator.planning import DesiredPod, pod_name
from weightlift.operator.pods import render_pod


def floor_pods(deployments: int, replicas: int, tensor: int, port: int) -> list[dict[str, Any]]:
    """Every worker pod of the run as the operator renders it (one source, the rest targets)."""
    pods = []
    for index in range(deployments):
        raw = manifest(index, replicas, tensor, port, period=10)
        spec = ModelDeploymentSpec.model_validate(raw["spec"])
        identity = model_identity(spec)
        name = raw["metadata"]["name"]
        for replica in range(replicas):
            role = Role.SOURCE if replica == 0 else Role.TARGET
            pod = pod_name(name, identity, replica)
            desired = DesiredPod(pod, replica, role, identity, [])
            body = render_pod(name, NAMESPACE, f"floor-{index}", spec, desired)
            body["metadata"].pop("ownerReferences", None)  # no owner: the GC would delete them
            pods.append(body)
    return pods


async def run_floor(
    stack: BenchStack,
    deployments: int,
    replicas: int,
    tensor: int,
    timeout: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    timeline = Timeline()
    pods = floor_pods(deployments, replicas, tensor, stack.worker_port)
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    async with AsyncKube(stack.info.kubeconfig) as kube:
        stop = asyncio.Event()
        watch = asyncio.create_task(kube.follow(pod_path, {}, timeline.on_pod, stop))
        await asyncio.sleep(0.5)
        load = MachineLoad()
        meters = {name: ProcessMeter(pid) for name, pid in stack.component_pids().items()}
        cpu0 = {name: m.cpu_seconds() for name, m in meters.items()}
        start = time.time()
        created: dict[str, float] = {}
        await kube.create_all(pod_path, pods, created, concurrency=16)
        say(f"{len(pods)} pods created in {time.time() - start:.1f}s")
        deadline = start + timeout
        while len(timeline.pod_ready) < len(pods) and time.time() < deadline:
            await asyncio.sleep(0.5)
        end = time.time()
        cpu = {name: round(m.cpu_seconds() - cpu0[name], 1) for name, m in meters.items()}
        busy = load.busy()
        stop.set()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    total = len(pods)
    return {
        "pods": total,
        "all_ready": len(timeline.pod_ready) == total,
        "seconds_to_all_pods_ready": round(end - start, 2),
        "milestones_seconds": {
            "pods_created": quantiles(created, start, total),
            "pods_scheduled": quantiles(timeline.pod_scheduled, start, total),
            "pods_ready_in_kwok": quantiles(timeline.pod_ready, start, total),
        },
        "cpu_seconds_by_process": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
        "machine_busy_cores": busy,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def render_floor(result: dict[str, Any], command: str) -> str:
    lines = [
        f"$ {command}",
        f"control plane alone: {result['pods']} pods created by the bench (no operator)",
        "",
        f"{'seconds after the first create':<34}{'50%':>8}{'90%':>8}{'100%':>8}",
    ]
    for label, q in result["milestones_seconds"].items():
        cells = "".join(f"{'-' if v is None else v:>8}" for v in q.values())
        lines.append(f"{label.replace('_', ' '):<34}{cells}")
    state = "all Ready" if result["all_ready"] else "NOT all Ready"
    lines += [
        "",
        f"create -> all pods Ready          {result['seconds_to_all_pods_ready']}s ({state})",
        "CPU seconds by process:",
        *(f"  {name:<32}{cpu}" for name, cpu in result["cpu_seconds_by_process"].items()),
        f"machine busy cores                {result['machine_busy_cores']} of {os.cpu_count()}; "
        f"load average {result['loadavg_1m_at_end']}",
    ]
    return "\n".join(lines)
