"""`weightlift node`: run a process node against a kubeconfig until interrupted."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import click

from weightlift.local.processnode.node import ProcessNode


@click.command("node")
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="Kubeconfig of the cluster to join.",
)
@click.option("--name", default="local-0", show_default=True, help="Node name.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/node"),
    show_default=True,
    help="Pod dirs, logs and emptyDir volumes live here.",
)
@click.option(
    "--gpus", type=int, default=8, show_default=True, help="nvidia.com/gpu capacity to advertise."
)
@click.option("--gpu-product", default="NVIDIA-H100-80GB-HBM3", show_default=True)
@click.option("--label", "labels", multiple=True, help="Extra node label KEY=VALUE.")
@click.option("--env", "extra_env", multiple=True, help="Extra process env KEY=VALUE.")
@click.option("--keep-node", is_flag=True, help="Do not delete the Node object on exit.")
@click.option("-v", "--verbose", is_flag=True)
def node_command(
    kubeconfig: Path,
    name: str,
    state_dir: Path,
    gpus: int,
    gpu_product: str,
    labels: tuple[str, ...],
    extra_env: tuple[str, ...],
    keep_node: bool,
    verbose: bool,
) -> None:
    """Run pods bound to this node as local processes (local mode; no containers)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    node = ProcessNode(
        kubeconfig,
        name,
        state_dir,
        gpus=gpus,
        gpu_product=gpu_product,
        labels=dict(kv.split("=", 1) for kv in labels),
        extra_env=dict(kv.split("=", 1) for kv in extra_env),
        delete_node_on_stop=not keep_node,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.start()
    click.echo(f"process node {name} ready; pods run under {state_dir}", err=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        node.stop()
