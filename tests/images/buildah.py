"""buildah, as the image tests use it: build through hack/build-images.sh, inspect an image, run a
command in a fresh container of it, list its files, and run a command the way a pod runs it (uid
1000, read-only root, an emptyDir-like /tmp). Needs root (buildah's storage, `buildah mount`,
mount namespaces)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 3600


def buildah(*args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout


def build(*targets: str) -> dict[str, str]:
    """target -> image name, built (or found up to date) by hack/build-images.sh."""
    if not os.environ.get("WEIGHTLIFT_IMAGES"):
        pytest.skip(
            "image tests build the images with buildah (minutes, GBs); "
            "run `make test-images` or set WEIGHTLIFT_IMAGES=1"
        )
    done = subprocess.run(
        [str(REPO / "hack" / "build-images.sh"), *targets],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"hack/build-images.sh failed:\n{done.stderr[-4000:]}"
    built = {}
    for line in done.stdout.splitlines():
        target, image, _seconds = line.split()
        built[target] = image
    assert set(built) == set(targets), done.stdout
    return built


def inspect(image: str) -> dict[str, object]:
    found = json.loads(buildah("inspect", "--type", "image", image))
    assert isinstance(found, dict)
    return found


def config(image: str) -> dict[str, object]:
    found = inspect(image)["OCIv1"]
    assert isinstance(found, dict) and isinstance(found["config"], dict)
    return found["config"]


@contextmanager
def container(image: str) -> Iterator[str]:
    name = buildah("from", "--pull-never", image).strip()
    try:
        yield name
    finally:
        buildah("rm", name)


def attempt(image: str, *command: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `command` in a fresh container of `image` (chroot isolation) as `user`, or as the
    image's configured user."""
    with container(image) as ctr:
        as_user = ["--user", user] if user else []
        argv = ["buildah", "run", "--isolation", "chroot", *as_user, ctr, "--", *command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def run(image: str, *command: str, user: str | None = None) -> str:
    done = attempt(image, *command, user=user)
    assert done.returncode == 0, f"{command} in {image} exited {done.returncode}: {done.stderr}"
    return done.stdout


def files(image: str) -> list[str]:
    """Every path in the image's root filesystem, relative to /."""
    with container(image) as ctr:
        root = Path(buildah("mount", ctr).strip())
        try:
            return [str(p.relative_to(root)) for p in root.rglob("*")]
        finally:
            buildah("umount", ctr)


# A pod's view of the image: its own mount and PID namespaces, the root filesystem read-only,
# tmpfs at /tmp (the pod's emptyDir) and /dev/shm, the image's environment and working directory,
# uid and gid 1000. The namespaces end with the command, and their mounts with them.
_POD_SHELL = """
set -e
R=$1; shift
mount --bind "$R" "$R"
mount -o remount,bind,ro "$R"
mount -t tmpfs -o size=2g tmpfs "$R/tmp"
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o size=1g tmpfs "$R/dev/shm"
mount --rbind /sys "$R/sys"
exec chroot --userspec=1000:1000 "$R" "$@"
"""


def run_as_pod(image: str, *command: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cfg = config(image)
    env = [str(e) for e in cfg.get("Env") or []]  # type: ignore[union-attr]
    workdir = str(cfg.get("WorkingDir") or "/")
    inner = f"cd {shlex.quote(workdir)} && exec {shlex.join(command)}"
    with container(image) as ctr:
        root = buildah("mount", ctr).strip()
        try:
            argv = [
                "unshare", "--mount", "--pid", "--fork", "--propagation", "private",
                "sh", "-c", _POD_SHELL, "pod", root,
                "/usr/bin/env", "-i", *env, "/bin/sh", "-c", inner,
            ]  # fmt: skip
            return subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, check=False
            )
        finally:
            buildah("umount", ctr)


def dev_only_code(paths: list[str]) -> list[str]:
    return [p for p in paths if "/weightlift/local" in f"/{p}" or "/weightlift/bench" in f"/{p}"]
