"""A stack of the real node (weightlift/local/kubeletnode/) held by a module's e2e tests."""

from __future__ import annotations

from collections.abc import Iterator

from weightlift.local.kubeletnode import KubeletNode
from weightlift.local.stack import LocalStack


def node_stack(stack: LocalStack) -> Iterator[LocalStack]:
    """A module fixture's body (`yield from node_stack(stack)`): `stack`, of node_kind kubelet,
    up while the module's tests run; once it is down, nothing of its node is left on this
    machine (mounts, cgroups, network namespace), so the next node starts clean."""
    with stack:
        yield stack
    node = stack.node
    assert isinstance(node, KubeletNode)
    assert not node.leftovers()
