"""`inside`: a container path resolved within an image's root filesystem, symlinks included,
never escaping into the host's tree (a chrooted pod's mountpoints are made there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightlift.local.images import container_name
from weightlift.local.podidentity import MountError, inside
from weightlift.local.stack import _image_values


def test_absolute_symlinks_resolve_within_the_root(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")  # as on Debian: /var/run -> /run
    got = inside(root, "/var/run/secrets/kubernetes.io/serviceaccount")
    assert got == root / "run" / "secrets" / "kubernetes.io" / "serviceaccount"


def test_relative_symlinks_and_dotdot_stay_below_the_root(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "escape").symlink_to("../../../etc")
    assert inside(root, "/lib/x") == root / "usr" / "lib" / "x"
    assert inside(root, "/escape/passwd") == root / "etc" / "passwd"
    assert inside(root, "/../../x") == root / "x"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    (root / "a").symlink_to("/b")
    (root / "b").symlink_to("/a")
    with pytest.raises(MountError, match="too many symlinks"):
        inside(root, "/a/x")


def test_chart_image_values_and_rootfs_names() -> None:
    assert _image_values("") == {}
    assert _image_values("reg:5000/wl/op:0.1.0") == {
        "image": {"repository": "reg:5000/wl/op", "tag": "0.1.0"}
    }
    with pytest.raises(ValueError, match="repository:tag"):
        _image_values("reg:5000/wl/op")
    assert container_name("a:1") != container_name("a:2")
    assert container_name("a:1").startswith("weightlift-rootfs-")
