"""Where the real node's binaries and images are (hack/build-node.sh, `make node`) and the
pinned versions (the script carries the same values; a test checks they agree)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from weightlift.local.cluster import K8S_VERSION, cache_dir

CRICTL_VERSION = "v1.36.0"
REGISTRY_VERSION = "v3.0.0"
# buildah's local name of the pause image; the stack pushes it to its registry.
PAUSE_IMAGE = "localhost/weightlift/pause:3.10"
NODE_BINARIES = ("kubelet", "kube-proxy", "weightlift-gpu-plugin", "crictl")
# Debian's packages (hack/build-node.sh installs them): name -> where it must be.
SYSTEM_BINARIES = {
    "containerd": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "buildah": "buildah",
    "nsenter": "nsenter",
    "ip": "ip",
}
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")


class NodeError(RuntimeError):
    """The node is missing a piece, failed to start, or did not become Ready."""


def node_bin_dir(cache: Path | None = None) -> Path:
    base = cache if cache is not None else cache_dir()
    return base / f"node-k8s{K8S_VERSION}-crictl{CRICTL_VERSION}" / "bin"


def registry_binary(cache: Path | None = None) -> Path:
    base = cache if cache is not None else cache_dir()
    return base / f"registry-{REGISTRY_VERSION}" / "bin" / "registry"


def missing(cache: Path | None = None) -> list[str]:
    """What `make node` (and `make registry`) would still have to build or install."""
    out = [b for b in NODE_BINARIES if not os.access(node_bin_dir(cache) / b, os.X_OK)]
    out += [name for name, exe in SYSTEM_BINARIES.items() if shutil.which(exe) is None]
    out += [f"cni/{p}" for p in CNI_PLUGINS if not os.access(CNI_BIN_DIR / p, os.X_OK)]
    if not os.access(registry_binary(cache), os.X_OK):
        out.append("registry")
    return out


def binary(name: str, cache: Path | None = None) -> str:
    if name in NODE_BINARIES:
        return str(node_bin_dir(cache) / name)
    if name == "registry":
        return str(registry_binary(cache))
    found = shutil.which(SYSTEM_BINARIES.get(name, name))
    if found is None:
        raise NodeError(f"{name} not found: run `make node` (hack/build-node.sh)")
    return found
