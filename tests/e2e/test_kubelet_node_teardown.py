"""The real node's tear-down leaves nothing behind (no process, mount, cgroup, network
namespace, link, route, host file), so a second node on the same machine starts clean. Its own
module: one real node per machine at a time. Needs root and `make node`."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_kubelet_node import NS, _node, _pause_pod, _require_node, _wait_running
from weightlift.local.kube import call
from weightlift.local.kubeletnode import leftovers
from weightlift.local.stack import LocalStack


def test_tear_down_leaves_nothing_and_a_second_node_starts_clean(tmp_path: Path) -> None:
    _require_node()
    for attempt in range(2):
        stack = LocalStack(
            tmp_path / f"s{attempt}",
            node_kind="kubelet",
            node_name=f"again-{attempt}",
            gpus=1,
            images=(),
        )
        with stack:
            node = _node(stack)
            call(stack.kube.core.create_namespaced_pod, NS, _pause_pod(stack, "p"))
            _wait_running(stack, "p")
            net, state, root = node.net, node.state_dir, node.cgroup_root
        left = leftovers(net, state, root)
        assert not left, left
        assert not Path(f"/run/netns/{net.netns}").exists()
