"""What a node's tear-down undoes, and the check that nothing of it is left: processes,
mounts, cgroups, the kernel sysctls the kubelet sets, its log links. (The network goes with
the node's namespace: network.py.) Every function is safe to run twice and on a node that
never fully started, so a crashed run's leftovers are cleared the same way."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
# The kernel settings the kubelet writes at start (container_manager_linux.go
# setupKernelTunables); restored to what they were before it ran.
KUBELET_SYSCTLS = ("kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory")
CONTAINER_LOG_LINKS = Path("/var/log/containers")
CNI_CACHE = Path("/var/lib/cni")
_MNT_DETACH = 2
_LIBC = ctypes.CDLL(None, use_errno=True)


# -- processes
def _netns_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def processes_in(netns: Path, cgroup_dirs: Iterable[Path], markers: Iterable[str]) -> set[int]:
    """Pids in the node's network namespace, in its cgroups, or whose command line names one
    of `markers` (containerd's socket: its shims; the node's config dir: the registry)."""
    needles = [m.encode() for m in markers]
    pids: set[int] = set()
    inode = _netns_inode(netns)
    for d in cgroup_dirs:
        for procs in d.rglob("cgroup.procs") if d.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in procs.read_text().split())
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if inode is not None and os.stat(entry / "ns" / "net").st_ino == inode:
                pids.add(int(entry.name))
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if any(n in cmdline for n in needles):
                pids.add(int(entry.name))
        except OSError:
            continue
    return {p for p in pids if p != me}


def kill_all(pids: set[int], grace: float = 5.0, first: signal.Signals = signal.SIGTERM) -> None:
    """`first` to each, SIGKILL to those left after `grace` seconds (a power cut: SIGKILL
    first)."""
    for sig, wait in ((first, grace), (signal.SIGKILL, 5.0)):
        live = {p for p in pids if Path(f"/proc/{p}").exists()}
        if not live:
            return
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_running(p) for p in live):
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# -- mounts
def mounts_under(roots: Iterable[Path]) -> list[str]:
    """Mount points at or below any of `roots`, deepest first."""
    prefixes = [str(Path(r).resolve()) for r in roots]
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def unmount_all(roots: Iterable[Path], rounds: int = 5) -> None:
    """Unmount everything under `roots` (the kubelet's bind of its own root dir shows up more
    than once: repeat until none is left); lazily when a mount is busy."""
    roots = list(roots)
    for _ in range(rounds):
        points = mounts_under(roots)
        if not points:
            return
        for point in points:
            if _LIBC.umount2(point.encode(), 0) != 0:
                _LIBC.umount2(point.encode(), _MNT_DETACH)


# -- cgroups
def cgroup_dirs(cgroup_root: str) -> list[Path]:
    """The node's cgroup root in every mounted hierarchy (v1 controllers, the named systemd
    one, the unified v2 one)."""
    rel = cgroup_root.strip("/")
    if not rel:
        return []
    with contextlib.suppress(OSError):
        return [h / rel for h in CGROUP_FS.iterdir() if h.is_dir() and not h.is_symlink()]
    return []


def make_cgroup_root(cgroup_root: str) -> None:
    """Create the root in every hierarchy (the kubelet requires it to exist); a cpuset
    cgroup starts with no CPUs and memory nodes in v1, so copy its parent's."""
    for d in cgroup_dirs(cgroup_root):
        d.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (d / knob).exists() and not (d / knob).read_text().strip():
                (d / knob).write_text((d.parent / knob).read_text())


def remove_cgroups(cgroup_root: str) -> None:
    for top in cgroup_dirs(cgroup_root):
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()


# -- sysctls
def read_sysctls() -> dict[str, str]:
    out = {}
    for name in KUBELET_SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = (Path("/proc/sys") / name).read_text().strip()
    return out


def restore_sysctls(saved: Path) -> None:
    try:
        values = json.loads(saved.read_text())
    except (OSError, ValueError):
        return
    for name, value in values.items():
        if name in KUBELET_SYSCTLS:
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / name).write_text(value)


# -- files the kubelet and CNI write outside the state dir
def host_files(state_dir: Path, network: str) -> list[Path]:
    """The kubelet's /var/log/containers links into this node's logs, and CNI's result cache
    of this node's network (libcni keeps /var/lib/cni/results/<network>-<sandbox>-<ifname>)."""
    out = []
    root = str(state_dir.resolve())
    if CONTAINER_LOG_LINKS.is_dir():
        for link in CONTAINER_LOG_LINKS.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(root):
                    out.append(link)
    out += list((CNI_CACHE / "results").glob(f"{network}-*"))
    return out


def missing_parents(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    out = []
    while not path.exists():
        out.append(path)
        path = path.parent
    return out


def made_dirs(record: Path) -> list[Path]:
    try:
        return [Path(p) for p in json.loads(record.read_text())]
    except (OSError, ValueError):
        return []


def clear_device_plugins(plugins: Path, record: Path) -> None:
    """The kubelet's and our plugin's sockets (weightlift-<resource>.sock) and the device
    manager's checkpoint, then the dirs the node created (deepest first, only when empty)."""
    if plugins.is_dir():
        for entry in plugins.iterdir():
            ours = entry.name.startswith("weightlift-") and entry.name.endswith(".sock")
            if ours or entry.name in ("kubelet.sock", "kubelet_internal_checkpoint"):
                with contextlib.suppress(OSError):
                    entry.unlink()
    for d in sorted(made_dirs(record), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()
