"""The real node's rendered configuration: what keeps its pods on this machine and what this
machine kind needs (see local/kubeletnode/). No root, no processes."""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import tomllib
from pathlib import Path

import yaml

from weightlift.local.cluster import K8S_VERSION, SERVICE_CIDR
from weightlift.local.kubeletnode import config, paths, registry
from weightlift.local.kubeletnode.network import NodeNetwork

REPO = Path(__file__).resolve().parents[3]


def test_slots_get_disjoint_private_networks() -> None:
    a, b = NodeNetwork(0), NodeNetwork(7)
    assert (a.host_ip, a.node_ip, a.pod_cidr) == ("10.250.0.1", "10.250.0.2", "10.251.0.0/24")
    assert (b.host_ip, b.node_ip, b.pod_cidr) == ("10.250.7.1", "10.250.7.2", "10.251.7.0/24")
    for net in (a, b):
        assert ipaddress.ip_network(net.pod_cidr).is_private
        assert ipaddress.ip_address(net.node_ip) in ipaddress.ip_network(net.link_cidr)
        assert not ipaddress.ip_network(net.pod_cidr).overlaps(ipaddress.ip_network(SERVICE_CIDR))
        assert len(net.host_link) <= 15 and len(net.node_link) <= 15  # IFNAMSIZ


def test_pods_get_no_masquerade_and_no_default_route(tmp_path: Path) -> None:
    net = NodeNetwork(3)
    doc = config.cni_conflist(config.Layout(tmp_path, tmp_path / "run"), net)
    bridge = doc["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["isGateway"] is True
    assert bridge["ipMasq"] is False
    dsts = {r["dst"] for r in bridge["ipam"]["routes"]}
    assert dsts == {SERVICE_CIDR, net.link_cidr}  # the API server's Service and the host end
    assert "0.0.0.0/0" not in dsts
    assert bridge["ipam"]["dataDir"].startswith(str(tmp_path))  # not /var/lib/cni/networks


def test_containerd_config_for_this_machine_kind(tmp_path: Path) -> None:
    lay, net = config.Layout(tmp_path, tmp_path / "run"), NodeNetwork(1)
    doc = tomllib.loads(config.containerd_toml(lay, net))
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True  # root here lacks CAP_SYS_RESOURCE
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["sandbox_image"] == f"{net.host_ip}:5000/weightlift/pause:3.10"
    assert cri["registry"]["config_path"] == str(lay.registry_hosts)
    # An image's compressed layers are dropped once unpacked (not kept twice on disk).
    assert cri["containerd"]["discard_unpacked_layers"] is True
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"]["SystemdCgroup"] is False
    for key in ("root", "state"):
        assert doc[key].startswith(str(tmp_path))
    assert doc["grpc"]["address"].startswith(str(tmp_path))


def test_registry_hosts_never_name_an_upstream() -> None:
    net = NodeNetwork(2)
    hosts = config.registry_hosts(net)
    plain, auth = f"{net.host_ip}:5000", f"{net.host_ip}:5001"
    assert set(hosts) == {plain, "ghcr.io", auth}
    for name, body in hosts.items():
        doc = tomllib.loads(body)
        served = auth if name == auth else plain  # the private one mirrors nothing
        assert doc["server"] == f"http://{served}"
        assert list(doc["host"]) == [f"http://{served}"]


def test_kubelet_config(tmp_path: Path) -> None:
    lay, net = config.Layout(tmp_path, tmp_path / "run"), NodeNetwork(0)
    doc = yaml.safe_load(config.kubelet_config(lay, net, tmp_path / "ca.crt", "/wl-0"))
    assert doc["failCgroupV1"] is False and doc["cgroupDriver"] == "cgroupfs"
    assert doc["cgroupRoot"] == "/wl-0" and doc["failSwapOn"] is False
    assert doc["address"] == net.node_ip
    assert doc["authentication"]["anonymous"]["enabled"] is False
    assert doc["imageGCHighThresholdPercent"] == 100
    assert doc["podLogsDir"].startswith(str(tmp_path))


def test_kube_proxy_iptables_without_localhost_node_ports(tmp_path: Path) -> None:
    doc = yaml.safe_load(config.kube_proxy_config(tmp_path / "kc", NodeNetwork(0), "n"))
    assert doc["mode"] == "iptables"
    assert doc["iptables"]["localhostNodePorts"] is False
    assert doc["conntrack"]["maxPerCore"] == 0


def test_pinned_versions_agree_with_the_build_script() -> None:
    script = (REPO / "hack" / "build-node.sh").read_text()

    def pinned(name: str) -> str:
        m = re.search(rf'^{name}="([^"]+)"', script, re.M)
        assert m, name
        return m.group(1)

    assert pinned("K8S_VERSION") == K8S_VERSION
    assert pinned("CRICTL_VERSION") == paths.CRICTL_VERSION
    assert pinned("PAUSE_IMAGE") == paths.PAUSE_IMAGE
    registry = (REPO / "hack" / "build-registry.sh").read_text()
    assert f'REGISTRY_VERSION="{paths.REGISTRY_VERSION}"' in registry


def test_registry_refs_drop_the_source_registry_and_localhost() -> None:
    net = NodeNetwork(3)
    reg = config.registry_address(net)
    assert config.registry_ref(net, paths.PAUSE_IMAGE) == config.pause_ref(net)
    assert config.registry_ref(net, "ghcr.io/weightlift/worker:0.1.0") == (
        f"{reg}/weightlift/worker:0.1.0"
    )
    assert config.registry_ref(net, "localhost/weightlift/prometheus:v3.16.0") == (
        f"{reg}/weightlift/prometheus:v3.16.0"
    )
    assert config.registry_ref(net, "weightlift/x:1") == f"{reg}/weightlift/x:1"


def test_the_private_registry_serves_the_same_storage_read_only_behind_auth(
    tmp_path: Path,
) -> None:
    net = NodeNetwork(4)
    plain = registry.registry_config(tmp_path / "data", config.registry_address(net))
    assert "auth" not in plain and "readonly" not in plain["storage"]["maintenance"]
    private = registry.private_registry(net)
    doc = registry.registry_config(tmp_path / "data", private.address, tmp_path / "htpasswd")
    assert doc["storage"]["filesystem"] == plain["storage"]["filesystem"]  # one storage
    assert doc["storage"]["maintenance"]["readonly"] == {"enabled": True}
    assert doc["auth"]["htpasswd"]["path"] == str(tmp_path / "htpasswd")
    assert doc["http"]["addr"] == f"{net.host_ip}:5001"
    assert private.ref("ghcr.io/weightlift/worker:0.1.0") == (
        f"{net.host_ip}:5001/weightlift/worker:0.1.0"
    )


def test_the_pull_secret_holds_the_htpasswd_users_credentials() -> None:
    private = registry.private_registry(NodeNetwork(4))
    secret = private.pull_secret("creds", "ns")
    assert secret["type"] == "kubernetes.io/dockerconfigjson"
    doc = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))
    entry = doc["auths"][private.address]
    assert base64.b64decode(entry["auth"]).decode() == f"{entry['username']}:{entry['password']}"
    user, _, digest = registry.htpasswd_line().strip().partition(":")
    assert user == entry["username"] and digest.startswith("$2b$")  # bcrypt: all it reads
