"""What a kubelet gives a pod to reach the API server, for the process node.

A pod that automounts a ServiceAccount token gets, from the ServiceAccount admission plugin, a
projected volume (a TokenRequest token bound to the pod, the cluster CA from the
`kube-root-ca.crt` ConfigMap, the namespace) mounted at /var/run/secrets/kubernetes.io/
serviceaccount; the process node writes its files under the pod dir like any projected volume.
Clients read that path literally (kubernetes' `load_incluster_config`, kopf's login), so a
container with a mount below /var/run/secrets runs in a mount namespace of its own with the
directory bind-mounted there read-only, as a container runtime does: its view changes, the
host's does not (only the empty mountpoint directory exists on the host).

Every pod also gets KUBERNETES_SERVICE_HOST/PORT: the API server's own address here, since
there is no kube-proxy behind the `kubernetes` Service's cluster IP.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# Mounts below this root are made for real: clients hard-code paths below it.
SECRETS_ROOT = "/var/run/secrets"
SERVICE_ACCOUNT_DIR = f"{SECRETS_ROOT}/kubernetes.io/serviceaccount"

_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18

try:  # loaded in the parent: a preexec_fn must not dlopen after fork (the loader lock)
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not glibc
    _LIBC = None


class MountError(Exception):
    """A mount the pod needs cannot be made on this machine."""


def kubernetes_service_env(server: str) -> dict[str, str]:
    """The variables the kubelet sets for the `kubernetes` Service (what in-cluster clients
    read), pointing at `server` (https://host:port)."""
    url = urlsplit(server)
    host, port = url.hostname or "127.0.0.1", str(url.port or 443)
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": port,
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


def real_mounts(
    container: dict[str, Any], translate: Callable[[str], str]
) -> list[tuple[str, str]]:
    """(local dir, mountPath) of the container's mounts below /var/run/secrets; `translate`
    maps a mountPath to the local directory the process node made for it."""
    binds: list[tuple[str, str]] = []
    for vm in container.get("volumeMounts", []):
        target = vm["mountPath"].rstrip("/")
        if target == SECRETS_ROOT or target.startswith(SECRETS_ROOT + "/"):
            binds.append((translate(target), target))
    return binds


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _bind(libc: ctypes.CDLL, source: str, target: str) -> None:
    _check(libc.mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), "bind")
    flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
    _check(libc.mount(None, target.encode(), None, flags, None), "remount read-only")


def with_mounts(
    preexec: Callable[[], None] | None, binds: list[tuple[str, str]]
) -> Callable[[], None]:
    """A `preexec_fn`: `preexec`, then a private mount namespace with each (source, target)
    bind-mounted read-only. Runs between fork and exec: only preloaded libc calls."""
    libc = _LIBC
    assert libc is not None
    unshare, mount = libc.unshare, libc.mount

    def run() -> None:
        if preexec is not None:
            preexec()
        _check(unshare(_CLONE_NEWNS), "unshare")
        _check(mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for source, target in binds:
            _bind(libc, source, target)

    return run


def inside(root: Path, path: str) -> Path:
    """Absolute `path` as seen from a chroot at `root`, on the host's side: symlinks (say
    /var/run -> /run) resolve within `root`, never into the host's tree."""
    parts = list(Path(path).parts[1:])
    resolved, hops = root, 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved.parent if resolved != root else root
            continue
        step = resolved / part
        if not step.is_symlink():
            resolved = step
            continue
        hops += 1
        if hops > 40:  # the kernel's limit
            raise MountError(f"{path}: too many symlinks below {root}")
        link = Path(os.readlink(step))
        if link.is_absolute():
            resolved, parts = root, [*link.parts[1:], *parts]
        else:
            parts = [*link.parts, *parts]
    return resolved


def in_root(
    preexec: Callable[[], None] | None,
    root: str,
    binds: list[tuple[str, str]],
    workdir: str,
) -> Callable[[], None]:
    """A `preexec_fn` that runs the process in an image's root filesystem: `preexec`, a private
    mount namespace, the host's /proc, /dev and /sys and each (source, host-side target, see
    `inside`) bind-mounted into `root` (the binds read-only), then chroot and chdir."""
    libc = _LIBC
    assert libc is not None
    unshare, mount, chroot, chdir = libc.unshare, libc.mount, libc.chroot, libc.chdir
    system = [(d.encode(), f"{root}{d}".encode()) for d in ("/proc", "/dev", "/sys")]
    new_root, new_cwd = root.encode(), workdir.encode()

    def run() -> None:
        if preexec is not None:
            preexec()
        _check(unshare(_CLONE_NEWNS), "unshare")
        _check(mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for host_dir, in_image in system:
            _check(mount(host_dir, in_image, None, _MS_BIND | _MS_REC, None), "bind")
        for source, target in binds:
            _bind(libc, source, target)
        _check(chroot(new_root), "chroot")
        _check(chdir(new_cwd), "chdir")

    return run


def prepare_mountpoints(binds: list[tuple[str, str]]) -> None:
    """Make sure mount namespaces work here and each target directory exists (an empty
    directory on the host, as on any node image); MountError says why not."""
    if not _mount_namespaces_work():
        raise MountError(
            f"pods with mounts below {SECRETS_ROOT} (a ServiceAccount token) need a mount "
            "namespace: run the process node as root (CAP_SYS_ADMIN)"
        )
    for source, target in binds:
        if not Path(source).is_dir():
            raise MountError(f"mount {target}: {source} is not a directory")
        try:
            Path(target).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MountError(f"mount {target}: cannot create the mountpoint: {exc}") from exc


@functools.cache
def _mount_namespaces_work() -> bool:
    if _LIBC is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
