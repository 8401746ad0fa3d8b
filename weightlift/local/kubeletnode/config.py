"""The files a real node runs from: containerd's config and registry hosts, the CNI network,
kubeconfigs, KubeletConfiguration and KubeProxyConfiguration. Pure rendering: node.py writes
them under the node's state dir."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from weightlift.local.cluster import SERVICE_CIDR
from weightlift.local.kubeletnode.network import BRIDGE, NodeNetwork
from weightlift.local.kubeletnode.paths import CNI_BIN_DIR

# Registries whose images the node pulls from the stack's registry instead (a pull-through
# mirror, as an air-gapped cluster has): the chart's and the CRD's default images live there.
MIRRORED = ("ghcr.io",)
REGISTRY_PORT = 5000
# The same registry's storage served read-only behind htpasswd auth (registry.py): a private
# registry, as pods pull from one with an imagePullSecret.
AUTH_REGISTRY_PORT = 5001
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
# The kubelet's periodic pod sync (KubeletConfiguration syncFrequency; its default is 1 minute).
# A pod update (the standby hand-off's annotation) is synced at once; failing that, this resync
# (its pod workers jitter it up to 1.5x) re-projects the pod's downwardAPI files.
SYNC_FREQUENCY_SECONDS = 10


@dataclass(frozen=True)
class Layout:
    """Every directory and socket of one node: under its state dir, but containerd's state
    (its sockets: a unix socket path has at most 107 bytes) under `run`."""

    root: Path
    run: Path

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.run / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_state / "containerd.sock"

    @property
    def registry_hosts(self) -> Path:
        return self.root / "containerd" / "certs.d"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def device_plugins(self) -> Path:
        """Fixed by the kubelet (pluginapi.DevicePluginPath), whatever its --root-dir."""
        return DEVICE_PLUGINS

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def mount_roots(self) -> list[Path]:
        """Where the node's mounts live (overlay rootfs, netns, tmpfs volumes, the kubelet's
        bind of its root dir): nothing may stay mounted under these after tear-down."""
        return [self.root, self.run]


def layout(state_dir: Path, net: NodeNetwork) -> Layout:
    return Layout(state_dir, net.run_dir)


def registry_address(net: NodeNetwork) -> str:
    return f"{net.host_ip}:{REGISTRY_PORT}"


def auth_registry_address(net: NodeNetwork) -> str:
    return f"{net.host_ip}:{AUTH_REGISTRY_PORT}"


def registry_ref(net: NodeNetwork, image: str) -> str:
    """The image's name in the stack's registry (its path without the registry host, or
    `localhost/`): ghcr.io/weightlift/worker:0.1.0 lands as weightlift/worker:0.1.0, which
    containerd pulls as ghcr.io/... through its mirror; an image only this machine has
    (`localhost/...`) is named by a pod with this reference."""
    return f"{registry_address(net)}/{image_path(image)}"


def image_path(image: str) -> str:
    """An image's name without its registry host (or `localhost/`)."""
    first, _, rest = image.partition("/")
    return rest if rest and ("." in first or ":" in first or first == "localhost") else image


def pause_ref(net: NodeNetwork) -> str:
    return f"{registry_address(net)}/weightlift/pause:3.10"


def containerd_toml(layout: Layout, net: NodeNetwork) -> str:
    """containerd 1.6's config (version 2). `restrict_oom_score_adj`: root here lacks
    CAP_SYS_RESOURCE, and without it every sandbox fails in runc (nsexec cannot lower
    oom_score_adj). Pod network namespaces are mounted under the state dir."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{layout.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{layout.containerd_socket}"

[ttrpc]
  address = "{layout.containerd_state}/containerd.sock.ttrpc"

[debug]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{layout.root / "containerd" / "opt"}"

[{cri}]
  sandbox_image = "{pause_ref(net)}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  max_container_log_line_size = 16384

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
  # The compressed layers go once unpacked: the worker images (torch, vLLM) would otherwise
  # cost their size twice on a disk the kubelet already sees as mostly full.
  discard_unpacked_layers = true

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{layout.cni_conf}"
  max_conf_num = 1

[{cri}.registry]
  config_path = "{layout.registry_hosts}"
"""


def registry_hosts(net: NodeNetwork) -> dict[str, str]:
    """certs.d/<host>/hosts.toml: the stack's registry over plain HTTP, under its own name
    and as the mirror of MIRRORED (never the real upstream: `server` is the local one too);
    the authenticated one under its own name only (credentials come from the pod's secret)."""

    def plain_http(address: str) -> str:
        local = f"http://{address}"
        return f'server = "{local}"\n\n[host."{local}"]\n  capabilities = ["pull", "resolve"]\n'

    hosts = {host: plain_http(registry_address(net)) for host in (registry_address(net), *MIRRORED)}
    return {**hosts, auth_registry_address(net): plain_http(auth_registry_address(net))}


def cni_network(net: NodeNetwork) -> str:
    return f"weightlift-{net.slot}"


def cni_conflist(layout: Layout, net: NodeNetwork) -> dict[str, Any]:
    """A bridge with host-local IPAM. No masquerade, and pods get routes to the Service CIDR
    and the host link only (no default route): they reach the API server, each other and
    nothing beyond this machine."""
    return {
        "cniVersion": "1.0.0",
        "name": cni_network(net),
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.pod_cidr, "gateway": net.pod_gateway}]],
                    "routes": [{"dst": SERVICE_CIDR}, {"dst": net.link_cidr}],
                    "dataDir": str(layout.cni_ipam),
                },
            },
            {"type": "loopback"},
        ],
    }


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "weightlift",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                },
            }
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [{"name": "weightlift", "context": {"cluster": "weightlift", "user": user}}],
        "current-context": "weightlift",
    }
    return yaml.safe_dump(doc, sort_keys=False)


def kubelet_config(layout: Layout, net: NodeNetwork, ca: Path, cgroup_root: str) -> str:
    """KubeletConfiguration for this machine kind: cgroup v1 (failCgroupV1 false, cgroupfs),
    swap tolerated, and eviction/image GC thresholds lowered: root may use only part of the
    filesystem the kubelet measures, so its percentages read it as mostly full."""
    socket = f"unix://{layout.containerd_socket}"
    doc = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": net.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": socket,
        "imageServiceEndpoint": socket,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "resolvConf": "",
        "podLogsDir": str(layout.pod_logs),
        "serializeImagePulls": False,
        "runtimeRequestTimeout": "15m",
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 110,
        # Reacts to a pod update at once (the downwardAPI hand-off); the default is 1 minute
        # only for the periodic resync.
        "syncFrequency": f"{SYNC_FREQUENCY_SECONDS}s",
        "fileCheckFrequency": "20s",
        "nodeStatusReportFrequency": "10s",
        "shutdownGracePeriod": "0s",
        "staticPodPath": "",
    }
    return yaml.safe_dump(doc, sort_keys=False)


def kube_proxy_config(kubeconfig_path: Path, net: NodeNetwork, node_name: str) -> str:
    """iptables mode in the node namespace. conntrack values 0: leave the kernel's (they are
    not per-namespace); localhost node ports off (no route_localnet sysctl)."""
    doc = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "hostnameOverride": node_name,
        "clusterCIDR": net.pod_cidr,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{net.node_ip}/32"],
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"masqueradeAll": False, "localhostNodePorts": False},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def dump_json(doc: Any) -> str:
    return json.dumps(doc, indent=2) + "\n"
