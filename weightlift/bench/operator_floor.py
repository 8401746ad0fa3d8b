"""`weightlift bench operator --floor`: the control plane alone, no operator.

The bench itself does the least any operator must get done, on the same control plane: the
user's ModelDeployments (created as the operator run creates them, 8 at a time), each one's pods
as the operator renders them (owned by their deployment) as soon as the deployment exists, and
one status write per deployment once all its pods are Ready in kwok. The time to every
deployment Ready is the floor under any operator on this machine, and the CPU the API server,
etcd, scheduler and kwok spend on it is the control plane's share. (Until 2026-11-25 the floor
created the pods alone, all at once: it left out the deployments' creates and status writes,
which the operator run pays for too.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from weightlift.api.model import GROUP, PLURAL, VERSION, ModelDeploymentSpec, Role
from weightlift.bench.operator_measure import MachineLoad, Timeline, manifest, quantiles
from weightlift.bench.operator_stack import NAMESPACE, BenchStack, ProcessMeter
from weightlift.bench.watch import AsyncKube
from weightlift.operator.identity import model_identity
from weightlift.operator.planning import DesiredPod, pod_name
from weightlift.operator.pods import render_pod

MD_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
POD_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
CREATE_PODS, PATCH_STATUS = "create pods", "patch modeldeployments/status"


def floor_requests(replicas: int) -> dict[str, int]:
    """What the floor asks of the API server per deployment in the operator's place, as the
    audit log names it: its pods and one status write (the user's create of the deployment is
    made in both runs and counted in neither). FloorRun counts what it really sent."""
    return {CREATE_PODS: replicas, PATCH_STATUS: 1}


def deployment_pods(created: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods the operator would create for this deployment (one source, the rest targets),
    owned by it."""
    spec = ModelDeploymentSpec.model_validate(created["spec"])
    identity = model_identity(spec)
    name, uid = created["metadata"]["name"], created["metadata"]["uid"]
    pods = []
    for replica in range(spec.replicas):
        role = Role.SOURCE if replica == 0 else Role.TARGET
        desired = DesiredPod(pod_name(name, identity, replica), replica, role, identity, [])
        pods.append(render_pod(name, NAMESPACE, uid, spec, desired))
    return pods


class FloorRun:
    """Deployments, then their pods, then their Ready status, each step as soon as it can."""

    def __init__(self, manifests: list[dict[str, Any]]) -> None:
        self.timeline = Timeline()
        self.pods_created: dict[str, float] = {}
        self.manifests: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for body in manifests:
            self.manifests.put_nowait(body)
        self.pods: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ready: asyncio.Queue[str] = asyncio.Queue()
        self.pods_of: dict[str, set[str]] = {}
        self.marked: set[str] = set()
        self.requests: Counter[str] = Counter()  # the operator's share, by kind

    def on_pod(self, event: dict[str, Any]) -> None:
        self.timeline.on_pod(event)
        owner = self.timeline.pod_owner.get(event["object"]["metadata"]["name"])
        if owner is None or owner[0] in self.marked:
            return
        mine = self.pods_of.get(owner[0], set())
        if mine and mine <= self.timeline.pod_ready.keys():
            self.marked.add(owner[0])
            self.ready.put_nowait(owner[0])

    async def create_deployments(self, kube: AsyncKube) -> None:
        while not self.manifests.empty():
            body = self.manifests.get_nowait()
            created = await kube.create(MD_PATH, body)
            self.timeline.md_created[body["metadata"]["name"]] = time.time()
            pods = deployment_pods(created)
            self.pods_of[body["metadata"]["name"]] = {p["metadata"]["name"] for p in pods}
            for pod in pods:
                self.pods.put_nowait(pod)

    async def create_pods(self, kube: AsyncKube) -> None:
        while True:
            body = await self.pods.get()
            await kube.create(POD_PATH, body)
            self.requests[CREATE_PODS] += 1
            self.pods_created[body["metadata"]["name"]] = time.time()

    async def mark_ready(self, kube: AsyncKube) -> None:
        while True:
            deployment = await self.ready.get()
            await kube.patch_status(f"{MD_PATH}/{deployment}", {"phase": "Ready"})
            self.requests[PATCH_STATUS] += 1


async def run_floor(
    stack: BenchStack,
    deployments: int,
    replicas: int,
    tensor: int,
    timeout: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    port = stack.worker_port
    run = FloorRun([manifest(i, replicas, tensor, port, period=10) for i in range(deployments)])
    timeline = run.timeline
    total_pods = deployments * replicas
    async with AsyncKube(stack.info.kubeconfig) as kube:
        stop = asyncio.Event()
        watches = [
            asyncio.create_task(kube.follow(MD_PATH, {}, timeline.on_md, stop)),
            asyncio.create_task(kube.follow(POD_PATH, {}, run.on_pod, stop)),
        ]
        await asyncio.sleep(0.5)  # both watches open before the first create
        load = MachineLoad()
        meters = {name: ProcessMeter(pid) for name, pid in stack.component_pids().items()}
        cpu0 = {name: m.cpu_seconds() for name, m in meters.items()}
        start = time.time()
        # The operator run's concurrency: the bench's 8 creators, the operator's 16 API threads.
        workers = [asyncio.create_task(run.create_pods(kube)) for _ in range(16)]
        workers += [asyncio.create_task(run.mark_ready(kube)) for _ in range(8)]
        await asyncio.gather(*(run.create_deployments(kube) for _ in range(8)))
        say(f"{deployments} ModelDeployments created in {time.time() - start:.1f}s")
        deadline = start + timeout
        while len(timeline.md_ready) < deployments and time.time() < deadline:
            for worker in workers:
                if worker.done():
                    worker.result()  # a failed create or patch ends the run with its error
            await asyncio.sleep(0.5)
        end = time.time()
        cpu = {name: round(m.cpu_seconds() - cpu0[name], 1) for name, m in meters.items()}
        busy = load.busy()
        stop.set()
        for task in [*watches, *workers]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*watches, *workers, return_exceptions=True)
    all_ready = len(timeline.md_ready) == deployments
    return {
        "deployments": deployments,
        "pods": total_pods,
        "all_ready": all_ready,
        "seconds_to_all_ready": round(end - start, 2),
        "milestones_seconds": {
            "deployments_created": quantiles(timeline.md_created, start, deployments),
            "pods_created": quantiles(run.pods_created, start, total_pods),
            "pods_scheduled": quantiles(timeline.pod_scheduled, start, total_pods),
            "pods_ready_in_kwok": quantiles(timeline.pod_ready, start, total_pods),
            "deployments_ready": quantiles(timeline.md_ready, start, deployments),
        },
        "requests_per_deployment": {
            kind: round(n / deployments, 2) for kind, n in sorted(run.requests.items())
        },
        # As `bench operator` names its own, for the chart that draws one against the other.
        "api_requests": {"ramp_per_deployment": round(sum(run.requests.values()) / deployments, 2)},
        "cpu_seconds_by_process": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
        "machine_busy_cores": busy,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def render_floor(result: dict[str, Any], command: str) -> str:
    lines = [
        f"$ {command}",
        f"control plane alone: {result['deployments']} ModelDeployments, {result['pods']} pods "
        "and one status write each, made by the bench (no operator)",
        "",
        f"{'seconds after the first create':<34}{'50%':>8}{'90%':>8}{'100%':>8}",
    ]
    for label, q in result["milestones_seconds"].items():
        cells = "".join(f"{'-' if v is None else v:>8}" for v in q.values())
        lines.append(f"{label.replace('_', ' '):<34}{cells}")
    state = "all Ready" if result["all_ready"] else "NOT all Ready"
    lines += [
        "",
        f"create -> all deployments Ready   {result['seconds_to_all_ready']}s ({state})",
        "API requests per deployment (the operator's share):",
        *(f"  {kind:<32}{n}" for kind, n in result["requests_per_deployment"].items()),
        "CPU seconds by process:",
        *(f"  {name:<32}{cpu}" for name, cpu in result["cpu_seconds_by_process"].items()),
        f"machine busy cores                {result['machine_busy_cores']} of {os.cpu_count()}; "
        f"load average {result['loadavg_1m_at_end']}",
    ]
    return "\n".join(lines)
