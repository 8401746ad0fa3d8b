"""`weightlift cluster up|down|status`: the local control plane (cluster.py) from the shell,
with a real node beside it on request (kubeletnode/). Apart from cluster.py so that the node,
which builds on the control plane, is not imported by it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from weightlift.local.cluster import CONTROLPLANE_BINARIES, ClusterInfo, ControlPlane, GpuNodeSpec


@click.group(name="cluster")
def cluster_group() -> None:
    """Start/stop a local control plane (etcd, kube-apiserver, scheduler, kwok GPU nodes)."""


_state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/cluster"),
    show_default=True,
    help="Where certs, kubeconfig, etcd data, logs and pids live.",
)


@cluster_group.command("up")
@_state_dir_option
@click.option("--kwok-nodes", type=click.IntRange(0, 1000), default=4, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(0, 64), default=8, show_default=True)
@click.option("--gpu-product", default=GpuNodeSpec.gpu_product, show_default=True)
@click.option("--timeout", type=float, default=120.0, show_default=True)
@click.option(
    "--node",
    "node_kind",
    type=click.Choice(["none", "kubelet"]),
    default="none",
    show_default=True,
    help="kubelet: also a real node (the pinned kubelet, containerd, runc, a CNI bridge in its "
    "own network namespace) named node-0, pulling images from a local registry (`make node`).",
)
def up_command(
    state_dir: Path,
    kwok_nodes: int,
    gpus_per_node: int,
    gpu_product: str,
    timeout: float,
    node_kind: str,
) -> None:
    """Start the control plane in the background and write STATE_DIR/kubeconfig."""
    started = time.monotonic()
    spec = GpuNodeSpec(count=kwok_nodes, gpus_per_node=gpus_per_node, gpu_product=gpu_product)
    net = None
    try:
        if node_kind == "kubelet":
            from weightlift.local.kubeletnode import allocate_network

            net = allocate_network(state_dir / "node")
        bind = net.host_ip if net is not None else "127.0.0.1"
        info = ControlPlane(state_dir, nodes=spec, timeout=timeout, bind_address=bind).up()
        if net is not None:
            _start_kubelet_node(info, net, state_dir / "node", gpus_per_node)
    except Exception as exc:
        if net is not None:
            from weightlift.local.kubeletnode import release_network

            release_network(net, state_dir / "node")
            ControlPlane(state_dir).down()
        raise click.ClickException(str(exc)) from exc
    click.echo(f"control plane up in {time.monotonic() - started:.1f}s: {info.server}")
    if info.nodes:
        click.echo(f"nodes: {', '.join(info.nodes)} ({gpus_per_node} x nvidia.com/gpu each)")
    if net is not None:
        click.echo(f"real node node-0: node IP {net.node_ip}, pods {net.pod_cidr}")
    click.echo(f"logs: {info.state_dir / 'logs'}")
    click.echo(f"export KUBECONFIG={info.kubeconfig}")


def _start_kubelet_node(info: ClusterInfo, net: Any, node_dir: Path, gpus: int) -> None:
    """A real node that outlives this command (`cluster down` takes it down)."""
    from weightlift.api.model import DEFAULT_WORKER_IMAGE
    from weightlift.local.kubeletnode import KubeletNode, network

    node = KubeletNode(
        info,
        net,
        "node-0",
        node_dir,
        gpus=gpus,
        images=(DEFAULT_WORKER_IMAGE,),
        bind_to_parent=False,
    )
    node.start()
    network.set_owner(net, node.pid("containerd"), node.state_dir)


@cluster_group.command("down")
@_state_dir_option
def down_command(state_dir: Path) -> None:
    """Stop every component `cluster up` started in STATE_DIR (and its real node)."""
    node_file = state_dir / "node" / "node.json"
    if node_file.is_file():
        from weightlift.local.kubeletnode import NodeNetwork, release_network

        slot = int(json.loads(node_file.read_text())["slot"])
        release_network(NodeNetwork(slot), state_dir / "node")
        node_file.unlink()
    stopped = ControlPlane(state_dir).down()
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@cluster_group.command("status")
@_state_dir_option
def status_command(state_dir: Path) -> None:
    """Show which components of STATE_DIR's control plane are running."""
    running = ControlPlane(state_dir).running()
    for name in CONTROLPLANE_BINARIES:
        pid = running.get(name)
        click.echo(f"{name:<24} {'running pid ' + str(pid) if pid else 'stopped'}")
    if len(running) != len(CONTROLPLANE_BINARIES):
        raise SystemExit(1)
