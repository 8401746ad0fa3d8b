"""The node's network: a network namespace of its own, joined to the host by one veth pair.

    host netns                          node netns wl-node-<slot>
    wlh<slot> 10.250.<slot>.1/30  <-->  wln<slot> 10.250.<slot>.2/30 (the node IP)
    route 10.251.<slot>.0/24 via .2     bridge wlbr0 10.251.<slot>.1/24 (CNI) -- pods

containerd, the kubelet and kube-proxy run in the node namespace, so the bridge, the pod
routes and every iptables rule the kubelet and kube-proxy write live there and go with it.
The API server and the registry listen on the host end (.1): pods reach them through the
bridge and the `kubernetes` Service (kube-proxy's DNAT). The host reaches pod IPs through its
one route into the namespace. Nothing masquerades, and no namespace of the stack has a
default route: pods reach nothing beyond this machine.

Slots let stacks on one machine run side by side: a slot is taken while the process that
took it (recorded in its owner file) lives; a dead owner's leftovers are removed on the next
allocation.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weightlift.local.kubeletnode.paths import NodeError
from weightlift.local.procs import pid_alive

RUN_DIR = Path("/run/weightlift")
NETNS_DIR = Path("/run/netns")
# One real node per machine: the kubelet's device-plugin socket is a fixed host path
# (/var/lib/kubelet/device-plugins/kubelet.sock, pluginapi.KubeletSocket, not under --root-dir),
# and a second kubelet would remove the first's plugin sockets. The slot machinery stays: it
# finds and clears what a crashed run left.
SLOTS = 1
LINK_BASE = ipaddress.ip_network("10.250.0.0/16")
POD_BASE = ipaddress.ip_network("10.251.0.0/16")
BRIDGE = "wlbr0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NodeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class NodeNetwork:
    slot: int

    @property
    def netns(self) -> str:
        return f"wl-node-{self.slot}"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def host_link(self) -> str:
        return f"wlh{self.slot}"

    @property
    def node_link(self) -> str:
        return f"wln{self.slot}"

    @property
    def _link_net(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((int(LINK_BASE.network_address) + (self.slot << 8), 30))

    @property
    def host_ip(self) -> str:
        """The host end: the API server and the registry listen here."""
        return str(self._link_net.network_address + 1)

    @property
    def node_ip(self) -> str:
        return str(self._link_net.network_address + 2)

    @property
    def link_cidr(self) -> str:
        return str(self._link_net)

    @property
    def pod_cidr(self) -> str:
        return str(ipaddress.IPv4Network((int(POD_BASE.network_address) + (self.slot << 8), 24)))

    @property
    def pod_gateway(self) -> str:
        return str(ipaddress.IPv4Network(self.pod_cidr).network_address + 1)

    @property
    def run_dir(self) -> Path:
        """Short paths for the node's sockets (containerd's state)."""
        return RUN_DIR / f"node-{self.slot}"

    @property
    def owner_file(self) -> Path:
        return RUN_DIR / f"node-{self.slot}.owner"

    def nsenter(self) -> list[str]:
        """The argv prefix that runs a command in the node namespace (network only: the mount
        namespace stays the host's, so cgroups, /sys and the pods' mounts are the host's)."""
        return ["nsenter", f"--net={self.netns_path}", "--"]

    # -- bring up / tear down
    def up(self) -> None:
        ip("netns", "add", self.netns)
        ns = ("-n", self.netns)
        ip(
            "link",
            "add",
            self.host_link,
            "type",
            "veth",
            "peer",
            "name",
            self.node_link,
            "netns",
            self.netns,
        )
        ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_link)
        ip("link", "set", self.host_link, "up")
        ip(*ns, "link", "set", "lo", "up")
        ip(*ns, "addr", "add", f"{self.node_ip}/30", "dev", self.node_link)
        ip(*ns, "link", "set", self.node_link, "up")
        ip("route", "add", self.pod_cidr, "via", self.node_ip, "dev", self.host_link)
        # The node routes between its link and the bridge (this namespace's own sysctl).
        subprocess.run(
            [*self.nsenter(), "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            check=True,
            capture_output=True,
        )

    def down(self) -> None:
        """Delete the namespace (its veth end, bridge, routes and iptables rules go with it)
        and the host end if the kernel has not removed it yet."""
        if self.netns_path.exists():
            ip("netns", "del", self.netns, check=False)
        if _empty_netns_mount():
            # `ip netns add` bind-mounts /run/netns onto itself (shared) the first time; with no
            # namespace left in it, that mount is ours to undo (the next `add` makes it again).
            subprocess.run(["umount", str(NETNS_DIR)], check=False, capture_output=True)
        if Path(f"/sys/class/net/{self.host_link}").exists():
            ip("link", "del", self.host_link, check=False)
        with contextlib.suppress(FileNotFoundError):
            self.owner_file.unlink()

    def leftovers(self) -> list[str]:
        out = []
        if self.netns_path.exists():
            out.append(f"network namespace {self.netns}")
        if _empty_netns_mount():
            out.append(f"mount {NETNS_DIR} (holds no namespace)")
        if Path(f"/sys/class/net/{self.host_link}").exists():
            out.append(f"link {self.host_link}")
        routes = ip("route", "show", self.pod_cidr, check=False).stdout.strip()
        if routes:
            out.append(f"route {routes}")
        return out


def owner(net: NodeNetwork) -> tuple[int, Path | None]:
    """(pid, state dir) of the slot's owner; (0, None) when nobody took it."""
    try:
        words = net.owner_file.read_text().split(maxsplit=1)
    except OSError:
        return 0, None
    pid = int(words[0]) if words and words[0].isdigit() else 0
    return pid, Path(words[1].strip()) if len(words) > 1 else None


def allocate(
    state_dir: Path,
    reclaim: Callable[[NodeNetwork, Path | None], None],
    owner_pid: int | None = None,
) -> NodeNetwork:
    """Take the first free slot (no owner, or a dead one), let `reclaim` clear what a dead
    owner left (its processes, mounts, cgroups: it knows the owner's state dir), record
    `owner_pid` (default: this process) with `state_dir`, and bring the network up."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with (RUN_DIR / "slots.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for slot in range(SLOTS):
            net = NodeNetwork(slot)
            pid, old_state = owner(net)
            if pid and pid_alive(pid):
                continue
            reclaim(net, old_state)
            net.down()  # a crashed run's namespace, links and route
            net.owner_file.write_text(f"{owner_pid or os.getpid()} {state_dir}\n")
            try:
                net.up()
            except BaseException:
                net.down()
                raise
            return net
    pid, state = owner(NodeNetwork(0))
    raise NodeError(
        f"another real node runs on this machine (process {pid}, state {state}); one at a time: "
        "the kubelet's device-plugin socket is a fixed host path"
    )


def set_owner(net: NodeNetwork, pid: int, state_dir: Path) -> None:
    """Hand the slot to another process (`cluster up`: the node outlives the command)."""
    net.owner_file.write_text(f"{pid} {state_dir}\n")


def _empty_netns_mount() -> bool:
    """/run/netns is still the mount `ip netns add` made, though no namespace is left in it."""
    mounted = any(
        line.split()[1] == str(NETNS_DIR)
        for line in Path("/proc/self/mounts").read_text().splitlines()
    )
    return mounted and NETNS_DIR.is_dir() and not any(NETNS_DIR.iterdir())
