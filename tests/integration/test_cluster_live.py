# The kubernetes client's models type every field Optional; these tests read objects the API
# server returned and fail loudly (AttributeError/TypeError) if a field is absent.
# mypy: disable-error-code="union-attr,index,arg-type"
"""The local control plane itself: versions, nodes, GC, service accounts, scheduler, CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from tests.support.cluster import REPO, Kubectl, wait_for
from weightlift.local import cluster as wl_cluster
from weightlift.local.cluster import ClusterInfo, ControlPlane, ControlPlaneError


def _shell_var(path: Path, name: str) -> str:
    m = re.search(rf'^{name}="([^"]+)"', path.read_text(), re.MULTILINE)
    assert m, f"{name} not found in {path}"
    return m.group(1)


def test_pinned_versions_agree() -> None:
    script = REPO / "hack" / "build-controlplane.sh"
    assert _shell_var(script, "K8S_VERSION") == wl_cluster.K8S_VERSION
    assert _shell_var(script, "ETCD_VERSION") == wl_cluster.ETCD_VERSION
    assert _shell_var(script, "KWOK_VERSION") == wl_cluster.KWOK_VERSION
    tools = (REPO / "hack" / "install_tools.py").read_text()
    assert f'KUBECTL_LAYER_VERSION = "{wl_cluster.KUBECTL_LAYER_VERSION}"' in tools
    printed = subprocess.run(
        [str(script), str(wl_cluster.cache_dir())],
        env={**os.environ, "WL_CONTROLPLANE_PRINT_DIR": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(printed) == wl_cluster.controlplane_bin_dir()


def test_missing_binary_error_names_make_target(tmp_path: Path) -> None:
    with pytest.raises(ControlPlaneError, match=r"make controlplane"):
        ControlPlane(tmp_path / "state", cache=tmp_path / "empty-cache").up()
    assert not (tmp_path / "state" / "pids.json").exists()


def test_server_reports_pinned_version(kubectl: Kubectl) -> None:
    out = json.loads(kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == wl_cluster.K8S_VERSION
    assert out["serverVersion"]["minor"] == wl_cluster.K8S_VERSION.split(".")[1]


def test_all_components_running_and_ready(cluster: ClusterInfo, kubectl: Kubectl) -> None:
    running = ControlPlane(cluster.state_dir).running()
    assert set(running) == set(wl_cluster.CONTROLPLANE_BINARIES)
    assert cluster.server.startswith("https://127.0.0.1:")
    assert kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    for name in wl_cluster.CONTROLPLANE_BINARIES:
        assert (cluster.state_dir / "logs" / f"{name}.log").exists()
    # RBAC is really on: an unknown user is forbidden, not everything-allowed
    proc = kubectl("auth", "can-i", "list", "pods", "--as=nobody", check=False)
    assert proc.stdout.strip() == "no"


def test_gpu_nodes_ready_with_labels(cluster: ClusterInfo, core: client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert set(cluster.nodes) <= set(nodes)
    assert len(cluster.nodes) == 4
    for name in cluster.nodes:
        node = nodes[name]
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.metadata.labels["node.kubernetes.io/instance-type"]
        assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"


def test_garbage_collector_follows_owner_references(core: client.CoreV1Api, namespace: str) -> None:
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="child", owner_references=[ref])),
    )
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        return "child" not in names

    wait_for(child_gone, 60, "garbage collector to delete the owned ConfigMap")


def test_service_account_tokens_are_issued(kubectl: Kubectl, namespace: str) -> None:
    token = kubectl("create", "token", "default", "-n", namespace).stdout.strip()
    assert token.count(".") == 2  # a signed JWT
    who = kubectl("auth", "whoami", f"--token={token}", "-o", "json").stdout
    assert json.loads(who)["status"]["userInfo"]["username"] == (
        f"system:serviceaccount:{namespace}:default"
    )


def _pod_state(core: client.CoreV1Api, ns: str, name: str) -> client.V1Pod:
    pod: client.V1Pod = core.read_namespaced_pod(name, ns)
    return pod


def test_scheduler_packs_gpus_and_reports_insufficient(
    core: client.CoreV1Api,
    namespace: str,
    make_pod: Callable[..., client.V1Pod],
    cluster: ClusterInfo,
) -> None:
    # 4 nodes x 8 GPUs: four 6-GPU pods fit one per node, a fifth 6-GPU pod cannot fit
    # (2 GPUs left per node), but a 2-GPU pod still does.
    for i in range(4):
        make_pod(namespace, f"big-{i}", 6)

    def bound() -> dict[str, str]:
        pods = core.list_namespaced_pod(namespace).items
        out = {str(p.metadata.name): str(p.spec.node_name) for p in pods if p.spec.node_name}
        return out if len(out) == 4 else {}

    placement = wait_for(bound, 60, "4 six-GPU pods bound")
    assert sorted(placement.values()) == sorted(cluster.nodes)  # one per node
    make_pod(namespace, "too-big", 6)
    make_pod(namespace, "small", 2)

    def unschedulable() -> str:
        pod = _pod_state(core, namespace, "too-big")
        conds = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        if conds and conds[0].status == "False" and conds[0].reason == "Unschedulable":
            return str(conds[0].message)
        return ""

    message = wait_for(unschedulable, 60, "too-big to be Unschedulable")
    assert "Insufficient nvidia.com/gpu" in message
    wait_for(lambda: _pod_state(core, namespace, "small").spec.node_name, 60, "small bound")
    assert _pod_state(core, namespace, "too-big").spec.node_name is None

    # kwok's default stages make bound pods Running and Ready
    def running_ready(name: str) -> bool:
        pod = _pod_state(core, namespace, name)
        ready = [c for c in pod.status.conditions or [] if c.type == "Ready"]
        return pod.status.phase == "Running" and bool(ready) and ready[0].status == "True"

    wait_for(lambda: running_ready("big-0"), 60, "big-0 Running/Ready via kwok")


def test_scheduler_respects_node_selector(
    core: client.CoreV1Api, namespace: str, make_pod: Callable[..., client.V1Pod]
) -> None:
    target = core.list_node().items[0].metadata.name
    make_pod(namespace, "pinned", 1, {"kubernetes.io/hostname": target})
    make_pod(namespace, "nowhere", 1, {"nvidia.com/gpu.product": "NVIDIA-B200"})
    wait_for(lambda: _pod_state(core, namespace, "pinned").spec.node_name, 60, "pinned bound")
    assert _pod_state(core, namespace, "pinned").spec.node_name == target

    def unschedulable() -> str:
        pod = _pod_state(core, namespace, "nowhere")
        conds = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        ok = conds and conds[0].reason == "Unschedulable"
        return str(conds[0].message) if ok else ""

    message = wait_for(unschedulable, 60, "nowhere to be Unschedulable")
    assert "node affinity/selector" in message or "didn't match" in message


def test_cluster_cli_up_status_down(state_root: Path, cluster: ClusterInfo) -> None:
    """`weightlift cluster up/status/down` as a user runs them, next to the session's cluster
    (distinct free ports); nothing is left running afterwards."""
    wl = str(REPO / ".venv" / "bin" / "weightlift")
    state = state_root / "cli-state"
    up = subprocess.run(
        [wl, "cluster", "up", "--state-dir", str(state), "--kwok-nodes=1", "--gpus-per-node=4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        assert f"export KUBECONFIG={state.resolve() / 'kubeconfig'}" in up.stdout
        second = json.loads((state / "cluster.json").read_text())
        assert second["server"] != cluster.server
        status = subprocess.run(
            [wl, "cluster", "status", "--state-dir", str(state)], capture_output=True, text=True
        )
        assert status.returncode == 0, status.stdout
        pids = ControlPlane(state).running()
        assert set(pids) == set(wl_cluster.CONTROLPLANE_BINARIES)
        kubectl = Kubectl(wl_cluster.tool_path("kubectl"), state / "kubeconfig")
        nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
        assert [n["status"]["allocatable"]["nvidia.com/gpu"] for n in nodes] == ["4"]
    finally:
        down = subprocess.run(
            [wl, "cluster", "down", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert up.returncode == 0
    assert down.returncode == 0, down.stderr
    assert "stopped:" in down.stdout
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    after = subprocess.run(
        [wl, "cluster", "status", "--state-dir", str(state)], capture_output=True, text=True
    )
    assert after.returncode == 1
    assert "running" not in after.stdout.replace("stopped", "")


def test_cluster_json_records_distinct_ports(cluster: ClusterInfo) -> None:
    ports = list(cluster.ports.values())
    assert len(set(ports)) == len(ports)
    assert str(cluster.ports["apiserver"]) in cluster.server
    info = json.loads((cluster.state_dir / "cluster.json").read_text())
    assert info["server"] == cluster.server
    assert info["upSeconds"] > 0


def test_failing_component_reports_log_tail_and_stops_the_rest(tmp_path: Path) -> None:
    """A component that dies at startup: the error names it with its log tail, and what was
    already started (etcd) is stopped."""
    real = wl_cluster.controlplane_bin_dir()
    if wl_cluster.missing_binaries():
        pytest.skip("control plane binaries missing (see the cluster fixture)")
    cache = tmp_path / "cache"
    bin_dir = wl_cluster.controlplane_bin_dir(cache)
    bin_dir.mkdir(parents=True)
    for name in wl_cluster.CONTROLPLANE_BINARIES:
        (bin_dir / name).symlink_to(real / name)
    wl_cluster.kwok_stages_file(cache).symlink_to(wl_cluster.kwok_stages_file())
    broken = bin_dir / "kube-apiserver"
    broken.unlink()
    broken.write_text("#!/bin/sh\necho 'E0000 simulated: cannot bind etcd storage' >&2\nexit 3\n")
    broken.chmod(0o755)
    cp = ControlPlane(tmp_path / "state", cache=cache, timeout=30)
    with pytest.raises(ControlPlaneError) as err:
        cp.up()
    text = str(err.value)
    assert "kube-apiserver exited with code 3" in text
    assert "simulated: cannot bind etcd storage" in text
    assert not (tmp_path / "state" / "pids.json").exists()
    ours = str(bin_dir)
    leftovers = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv0 = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if argv0.startswith(ours):
                leftovers.append(argv0)
    assert leftovers == []
    etcd_log = (tmp_path / "state" / "logs" / "etcd.log").read_text()
    assert etcd_log  # etcd did start, and was stopped again
