"""The real node by itself (local/kubeletnode/): the pinned kubelet registers a Ready node that
advertises GPUs through our device plugin, runs a pod in a sandbox with its own namespaces and
cgroup on the CNI bridge, reachable from the host, its device plugin handing the container the
node's fault gate; and its tear-down leaves nothing behind, so a second node on the same machine
starts clean. Needs root and `make node`."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightlift.local.kube import JSON, call
from weightlift.local.kubeletnode import KubeletNode, missing
from weightlift.local.stack import LocalStack
from weightlift.worker.p2p import faultgate

NS = "default"


def _require_node() -> None:
    absent = missing()
    if os.geteuid() != 0:
        absent.append("root")
    if not absent:
        return
    msg = f"real node unavailable: {', '.join(absent)}; run `make node` as root"
    if os.environ.get("WEIGHTLIFT_REQUIRE_NODE"):
        pytest.fail(msg + " [WEIGHTLIFT_REQUIRE_NODE is set]", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    _require_node()
    stack = LocalStack(
        tmp_path_factory.mktemp("knode") / "stack",
        node_kind="kubelet",
        node_name="kubelet-0",
        gpus=4,
        images=(),
    )
    with stack:
        yield stack


def _node(stack: LocalStack) -> KubeletNode:
    assert isinstance(stack.node, KubeletNode)
    return stack.node


def _pause_pod(stack: LocalStack, name: str) -> JSON:
    image = _node(stack).pause_image
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "nodeName": stack.node_name,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "c",
                    "image": image,
                    "resources": {"limits": {"memory": "64Mi", "nvidia.com/gpu": "1"}},
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}}],
        },
    }


def _wait_running(stack: LocalStack, name: str, timeout: float = 120.0) -> JSON:
    deadline = time.monotonic() + timeout
    pod: JSON = {}
    while time.monotonic() < deadline:
        pod = call(stack.kube.core.read_namespaced_pod, name, NS)
        if (pod.get("status") or {}).get("phase") == "Running" and pod["status"].get("podIP"):
            return pod
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not Running: {pod.get('status')}")


def test_node_is_ready_with_the_pinned_kubelet_and_gpus(kstack: LocalStack) -> None:
    node = call(kstack.kube.core.read_node, kstack.node_name)
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == _node(kstack).net.node_ip


def test_a_pod_runs_isolated_on_the_bridge(kstack: LocalStack) -> None:
    call(kstack.kube.core.create_namespaced_pod, NS, _pause_pod(kstack, "p1"))
    pod = _wait_running(kstack, "p1")
    node = _node(kstack)
    assert pod["status"]["podIP"].startswith(node.net.pod_cidr.rsplit(".", 2)[0])
    (pid,) = node.pids()[f"{NS}/p1"]
    for ns in ("pid", "ipc", "net", "mnt"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    memory = [ln for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":memory:" in ln]
    assert memory and f"{node.cgroup_root}/kubepods/" in memory[0], memory
    cgroup = Path("/sys/fs/cgroup/memory") / memory[0].split(":", 2)[2].lstrip("/")
    assert int((cgroup.parent / "memory.limit_in_bytes").read_text()) == 64 << 20
    # The host reaches the pod through its one route into the node's namespace: nothing
    # listens there, so the pod's own kernel answers with a reset (not a timeout).
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((pod["status"]["podIP"], 9), timeout=5)
    call(kstack.kube.core.delete_namespaced_pod, "p1", NS, grace_period_seconds=0)


def test_downward_api_file_follows_an_annotation_patch(kstack: LocalStack) -> None:
    """The standby hand-off's channel on the real kubelet: a pod annotation patch reaches the
    pod's downwardAPI file on the pod-update event, not on the 1-minute periodic sync."""
    from weightlift.api.labels import PEERS_ANNOTATION
    from weightlift.local.kube import MERGE

    pod = _pause_pod(kstack, "hand")
    pod["metadata"]["annotations"] = {PEERS_ANNOTATION: "0"}
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "peers", "mountPath": "/peers"})
    field = f"metadata.annotations['{PEERS_ANNOTATION}']"
    pod["spec"]["volumes"].append(
        {
            "name": "peers",
            "downwardAPI": {"items": [{"path": "peers", "fieldRef": {"fieldPath": field}}]},
        }
    )
    call(kstack.kube.core.create_namespaced_pod, NS, pod)
    _wait_running(kstack, "hand")
    (pid,) = _node(kstack).pids()[f"{NS}/hand"]
    seen = Path(f"/proc/{pid}/root/peers/peers")
    latencies = []
    for i in range(1, 6):
        patch = {"metadata": {"annotations": {PEERS_ANNOTATION: str(i)}}}
        sent = time.monotonic()
        call(kstack.kube.core.patch_namespaced_pod, "hand", NS, patch, _content_type=MERGE)
        while seen.read_text() != str(i):
            assert time.monotonic() - sent < 30, f"file still says {seen.read_text()!r}"
            time.sleep(0.005)
        latencies.append(time.monotonic() - sent)
    latencies.sort()
    print(f"annotation patch -> downwardAPI file on the real kubelet: {latencies} s")
    assert latencies[len(latencies) // 2] < 5.0, latencies
    call(kstack.kube.core.delete_namespaced_pod, "hand", NS, grace_period_seconds=0)


def test_the_device_plugin_hands_containers_the_fault_gate(kstack: LocalStack) -> None:
    """As a real device plugin hands over driver files and env, ours gives each container it
    allocates GPUs to the node's fault gate (worker/p2p/faultgate.py): named in its env with the
    marker the worker's gate honours, mounted read-write, writable by the workers' uid 1000."""
    call(kstack.kube.core.create_namespaced_pod, NS, _pause_pod(kstack, "gate"))
    _wait_running(kstack, "gate")
    node = _node(kstack)
    (pid,) = node.pids()[f"{NS}/gate"]
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert env.get(faultgate.LOCAL_NODE_ENV), env
    inside = env[faultgate.GATE_DIR_ENV]
    assert stat.S_IMODE(node.fault_gate_dir.stat().st_mode) == 0o777
    (node.fault_gate_dir / "seen").write_text("from the host")
    assert (Path(f"/proc/{pid}/root") / inside.lstrip("/") / "seen").read_text() == "from the host"
    # mountinfo: id parent major:minor root mount-point options ...
    mounts = {
        f[4]: f[5].split(",")
        for f in (ln.split() for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    }
    assert "rw" in mounts[inside], mounts
    (node.fault_gate_dir / "seen").unlink()
    call(kstack.kube.core.delete_namespaced_pod, "gate", NS, grace_period_seconds=0)
