"""`weightlift bench p2p --node kubelet`: P2P between real pods, measured honestly.

The same deployment (the demo's PT2 model, 2 replicas: a Source loading from storage and a
standby Target pulling from it over NIXL/UCX) runs on the real node (containers of the worker
image under the pinned kubelet: separate PID, IPC and network namespaces, a /dev/shm each) and,
in the same run, on the process node (host processes sharing them). Each row gives the loads'
GB/s from the status, each replica's time to Ready, and the UCX transport the Target's reads
really took: UCX_PROTO_INFO=y makes UCX print its protocol choice for each endpoint to the
worker's output ("remote memory read by ucp_get*" and the transport in its table), read back from
the pod's log. Between host processes UCX reads with cross-memory attach (cma); between pods,
which cannot see each other's processes, it has to go through the pod network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightlift.bench.ucxinfo import read_transports
from weightlift.local.nodekind import NodeKindName
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

JSON = dict[str, Any]
NAME = "p2p-node"
NODE_KINDS: tuple[NodeKindName, ...] = ("kubelet", "process")


def _pod_log(stack: LocalStack, pod: str) -> str:
    """The worker's output: the container log on the real node, the process's on the other."""
    logs = stack.node.pod_logs(stack.namespace, pod)
    return "\n".join(Path(p).read_text(errors="replace") for p in logs)


def node_row(kind: NodeKindName, state_dir: Path, size_mb: float, timeout: float) -> JSON:
    """One deployment of 2 replicas on a fresh stack of node `kind`; what its replicas say."""
    models = state_dir / "models"
    model_dir = models / "model"
    probe = make_demo_model(model_dir, size_mb)
    stack = LocalStack(
        state_dir / "stack",
        node_kind=kind,
        node_name=f"bench-{kind}",
        gpus=2,
        install="helm" if kind == "kubelet" else "process",
        model_path_prefixes=(str(models),),
        worker_env={} if kind == "kubelet" else {"CUDA_VISIBLE_DEVICES": ""},
    )
    with stack:
        env = {"UCX_PROTO_INFO": "y"}
        stack.apply(model_deployment(NAME, model_dir, replicas=2, probe=probe, env=env))
        obs = Observer(stack, NAME)
        obs.wait_ready(timeout)
        summary = obs.summary()
        rows = []
        for replica in summary["replicas"]:
            log = _pod_log(stack, replica["name"])
            rows.append(
                {
                    "replica": replica["name"],
                    "role": replica["role"],
                    "loadedFrom": replica["loadedFrom"],
                    "bytes": replica["bytesTotal"],
                    "loadSeconds": replica["loadSeconds"],
                    "gbps": replica["gbps"],
                    "secondsToReady": replica["secondsToReady"],
                    "readTransports": read_transports(log),
                }
            )
    return {"node": kind, "allReadySeconds": summary["secondsToReady"], "replicas": rows}


def print_node_table(nodes: list[JSON]) -> None:
    """One line per replica and node kind; the target's pull against its source's storage load
    on the same node, and the real node's against the process node's."""
    print(f"{'node':<9}{'role':<8}{'from':<26}{'GB/s':>7}{'load s':>8}{'ready s':>9}  reads via")
    for n in nodes:
        for r in n["replicas"]:
            gbps = f"{r['gbps']:.2f}" if r.get("gbps") is not None else "-"
            load = f"{r['loadSeconds']:.3f}" if r.get("loadSeconds") is not None else "-"
            ready = f"{r['secondsToReady']:.1f}" if r.get("secondsToReady") is not None else "-"
            via = ", ".join(r["readTransports"]) or "-"
            print(
                f"{n['node']:<9}{r['role']!s:<8}{r['loadedFrom']!s:<26}{gbps:>7}{load:>8}"
                f"{ready:>9}  {via}"
            )
    pulls = {n["node"]: _pull_gbps(n) for n in nodes}
    real, host = pulls.get("kubelet"), pulls.get("process")
    if real and host:
        print(f"pull between real pods / between host processes: {real / host:.2f}x")


def _pull_gbps(node: JSON) -> float | None:
    pulls = [r["gbps"] for r in node["replicas"] if str(r["loadedFrom"]).startswith("peer:")]
    return pulls[0] if pulls and pulls[0] else None
