"""The process node projects downwardAPI volumes as a kubelet does: files through a `..data`
symlink, rewritten atomically when the pod's annotations change (how a Target in standby is
handed its peers without a restart)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from weightlift.local.processnode import DATA_LINK, NodeConfig, PodRunner, write_atomic

ANNOTATION = "weightlift.dev/peers"


def _pod(value: str) -> dict[str, Any]:
    item = {
        "path": "peers.json",
        "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION}']"},
    }
    label = {"path": "role", "fieldRef": {"fieldPath": "metadata.labels['role']"}}
    return {
        "metadata": {
            "name": "t-1",
            "namespace": "ns",
            "uid": "uid-1",
            "annotations": {ANNOTATION: value},
            "labels": {"role": "Target"},
        },
        "spec": {
            "containers": [
                {"name": "w", "volumeMounts": [{"name": "peers", "mountPath": "/etc/peers"}]}
            ],
            "volumes": [{"name": "peers", "downwardAPI": {"items": [item, label]}}],
        },
    }


def _runner(tmp_path: Path, pod: dict[str, Any]) -> PodRunner:
    node: Any = SimpleNamespace(
        config=NodeConfig(name="n", state_dir=tmp_path), host_ip="127.0.0.1"
    )
    return PodRunner(node, pod, "127.0.9.9")


def test_the_file_follows_the_annotation_in_place(tmp_path: Path) -> None:
    pod = _pod("")
    runner = _runner(tmp_path, pod)
    mounts = runner._prepare_volumes(pod)
    ((mount_path, local),) = mounts
    assert mount_path == "/etc/peers"
    path = Path(local) / "peers.json"
    assert path.read_text() == "" and (Path(local) / "role").read_text() == "Target"
    assert path.is_symlink() and (Path(local) / DATA_LINK).is_symlink()
    first = (Path(local) / DATA_LINK).readlink()

    runner._refresh_downward(pod)  # nothing changed: nothing rewritten
    assert (Path(local) / DATA_LINK).readlink() == first

    handed = '{"peers":[{"pod":"s-0","address":"127.0.9.2:8000"}]}'
    pod["metadata"]["annotations"][ANNOTATION] = handed
    runner._refresh_downward(pod)
    assert path.read_text() == handed  # the same path the worker holds, new content
    second = (Path(local) / DATA_LINK).readlink()
    assert second != first and not (Path(local) / first).exists(), "the old dir is removed"
    assert sorted(p.name for p in Path(local).iterdir() if p.name.startswith("..2")) == [
        second.name
    ]


def test_a_reader_never_sees_a_half_written_file(tmp_path: Path) -> None:
    root = tmp_path / "vol"
    values = [("x" * 4096 * (i % 5 + 1)) + str(i) for i in range(200)]
    write_atomic(root, {"f": values[0]})
    seen: set[str] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            # The old dir may go between resolving ..data and opening: a reader retries.
            with contextlib.suppress(FileNotFoundError):
                seen.add((root / "f").read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for value in values[1:]:
        write_atomic(root, {"f": value})
    stop.set()
    reader.join()
    assert seen <= set(values), "a torn or empty read"
    assert (root / "f").read_text() == values[-1]
