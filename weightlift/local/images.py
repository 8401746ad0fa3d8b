"""Root filesystems of images `make images` built, for the process node to run containers in.

buildah keeps the images in its local storage; a working container of an image, mounted, is a
writable root filesystem of it (an overlay: the image's layers stay as they are). The process
node runs a container of a mapped image chrooted there (`NodeConfig.image_roots`), so the
process sees the image's files, Python and packages instead of this installation's. Needs root
(buildah's storage, `buildah mount`, chroot).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

PREFIX = "weightlift-rootfs-"


class ImageError(RuntimeError):
    """The image or buildah is missing; the message says what to run."""


def _buildah(*args: str) -> str:
    exe = shutil.which("buildah")
    if exe is None:
        raise ImageError("buildah is not installed: run `make images` (it installs it)")
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise ImageError(f"buildah {args[0]} {args[-1]}: {done.stderr.strip()}")
    return done.stdout.strip()


def container_name(image: str) -> str:
    return PREFIX + hashlib.sha256(image.encode()).hexdigest()[:12]


def image_rootfs(image: str) -> Path:
    """A mounted root filesystem of `image` (as built now): a fresh working container, named
    after the image, replacing the one an earlier call made; `release_rootfs` removes it."""
    try:
        _buildah("inspect", "--type", "image", image)
    except ImageError as exc:
        raise ImageError(f"image {image}: {exc}; run `make images`") from exc
    release_rootfs(image)
    name = container_name(image)
    _buildah("from", "--pull-never", "--name", name, image)
    return Path(_buildah("mount", name))


def release_rootfs(image: str) -> None:
    """Unmount and remove the working container `image_rootfs` made (nothing if none)."""
    exe = shutil.which("buildah")
    if exe is not None:
        rm = [exe, "rm", container_name(image)]
        subprocess.run(rm, capture_output=True, timeout=120, check=False)
