"""A real node for the local stack: the pinned kubelet and kube-proxy (built from Go modules,
hack/build-node.sh), Debian's containerd and runc, a CNI bridge in a network namespace of the
node's own, a device plugin advertising GPUs, images pulled from the stack's registry.

- network.py   the node's namespace, its veth to the host, the slots stacks share a machine by
- config.py    containerd, registry hosts, CNI, kubeconfigs, kubelet and kube-proxy configs
- registry.py  the stack's registry and its private (htpasswd) view: configs, pull secrets
- node.py      KubeletNode: start/stop, pids and logs of pods, leftovers
- teardown.py  processes, mounts, cgroups, sysctls: undone and checked
"""

from __future__ import annotations

from pathlib import Path

from weightlift.local.kubeletnode import network
from weightlift.local.kubeletnode.network import NodeNetwork
from weightlift.local.kubeletnode.node import KubeletNode, clear, leftovers, reclaim
from weightlift.local.kubeletnode.paths import NodeError, missing


def allocate_network(state_dir: Path) -> NodeNetwork:
    """A free slot's network, up, owned by this process (a dead owner's node cleared first)."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    return network.allocate(Path(state_dir).resolve(), reclaim)


def release_network(net: NodeNetwork, state_dir: Path) -> None:
    """Undo a node of `net` (all of it, idempotent) and free its slot."""
    clear(net, Path(state_dir).resolve(), f"/weightlift-node-{net.slot}")


__all__ = [
    "KubeletNode",
    "NodeError",
    "NodeNetwork",
    "allocate_network",
    "leftovers",
    "missing",
    "release_network",
]
