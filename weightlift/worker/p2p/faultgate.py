"""A hold the local stack's chaos harness puts on one pull, so a fault lands mid-transfer.

Since standby a target's pull of a small model lasts about 0.1 s: a harness that polls the
status for "a target pulling" misses it. Instead it arms this gate before it deploys; the first
target of that deployment to fetch a manifest claims it, pulls in small READs one at a time,
and after the first one has landed (others still to go, its peer session open, nothing in
flight) writes `held.<pod>` and waits. The harness reads that file (which peer, how far),
injects its fault and deletes the file; the pull goes on against whatever is left of its peer.

Honoured only on a local node: WEIGHTLIFT_FAULT_GATE_DIR with WEIGHTLIFT_PROCESS_NODE (the process
node's runner, local/processnode/runner.py) or WEIGHTLIFT_LOCAL_NODE (the real node's fake GPU
device plugin, hack/deviceplugin/main.go, which mounts the dir into each container it allocates
GPUs to, as a real device plugin injects env and mounts). The operator's pods carry none of them
(spec.template.env refuses WEIGHTLIFT_*), and a hold never outlives HOLD_LIMIT_SECONDS. Files in
the gate dir:
    arm.<deployment>   armed by the harness: one hold for that deployment's next pull
    claimed.<pod>      the arm, renamed by the target that took it (a rename: one winner)
    held.<pod>         JSON `Held`, written once the target holds; deleting it releases
A claim whose pull fails before its first READ lands is put back (`arm.<deployment>` again).

The same gate holds a worker at a step of its start (`wait_at`), for faults that must land
before something happens rather than mid-pull: STORAGE_LOAD holds a pod that loads from storage
(a Source, or a replica with no peer) after its front door answers (liveness passes, the status
endpoint says where it is) and before its engine starts, for as long as the harness wants.
GROUP_JOIN holds a pod of a multi-pod replica with its weights bound, before it joins its group.
Files:
    step.<step>.<deployment>   held by the harness: every pod of it reaching <step> waits
    pod.<step>.<pod>           held by the harness: that one pod waits (a group's leader, so
                               that its other pods go on and wait for it)
    at.<step>.<pod>            JSON `AtStep`, written by a pod while it waits there
A waiting pod waits while any hold of it is left, so the harness can narrow a deployment's
hold to one pod (hold that pod, then release the deployment) without letting it go between.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GATE_DIR_ENV = "WEIGHTLIFT_FAULT_GATE_DIR"
PROCESS_NODE_ENV = "WEIGHTLIFT_PROCESS_NODE"
# Set with the gate dir by the real node's device plugin (hack/deviceplugin/main.go).
LOCAL_NODE_ENV = "WEIGHTLIFT_LOCAL_NODE"
# A held pull gives up waiting after this long (a harness that died never wedges a worker).
HOLD_LIMIT_SECONDS = 300.0
# A gated pull moves its bytes in this many READs at least, one in flight at a time.
GATED_READS = 8
_POLL = 0.02
# A pod that will load its weights from storage, before its engine starts (worker/main.py).
STORAGE_LOAD = "storage-load"
# A pod of a multi-pod replica, its weights bound, before it joins its group
# (engines/builtin/engine.py): its group's other pods wait for it meanwhile.
GROUP_JOIN = "group-join"


@dataclass(frozen=True)
class Held:
    """What a held target says about its pull: the fault lands between READ `done` and the
    next one of `batches`."""

    pod: str
    peer: str
    address: str
    rank: int
    pid: int
    done: int
    batches: int
    bytes_done: int
    bytes_total: int

    @property
    def in_flight(self) -> bool:
        return 0 < self.done < self.batches and 0 < self.bytes_done < self.bytes_total


def gate_dir() -> Path | None:
    """The gate dir, on a local node only (process or real: see the module docstring)."""
    where = os.environ.get(GATE_DIR_ENV)
    if not where or not (os.environ.get(PROCESS_NODE_ENV) or os.environ.get(LOCAL_NODE_ENV)):
        return None
    return Path(where)


class Claim:
    """The target side: one pull holding the gate."""

    def __init__(self, folder: Path, deployment: str, pod: str) -> None:
        self.folder, self.deployment, self.pod = folder, deployment, pod
        self.held = False

    def read_bytes(self, total: int) -> int:
        """Bytes per READ for this pull: GATED_READS of them (4 KiB at least)."""
        return max(4096, -(-total // GATED_READS))

    def hold(self, info: Held) -> None:
        """Say where the pull stands and wait until the harness deletes the file."""
        path = self.folder / f"held.{self.pod}"
        tmp = self.folder / f".{path.name}.tmp"
        tmp.write_text(json.dumps(asdict(info)))
        tmp.rename(path)
        self.held = True
        (self.folder / f"claimed.{self.pod}").unlink(missing_ok=True)
        deadline = time.monotonic() + HOLD_LIMIT_SECONDS
        while path.exists() and time.monotonic() < deadline:
            time.sleep(_POLL)
        path.unlink(missing_ok=True)

    def close(self) -> None:
        """A pull that ended before it held puts the arm back for the next one."""
        if not self.held:
            claimed = self.folder / f"claimed.{self.pod}"
            if claimed.exists():
                claimed.rename(self.folder / f"arm.{self.deployment}")


@dataclass(frozen=True)
class AtStep:
    """A pod waiting at a held step."""

    pod: str
    step: str
    pid: int


def _listing() -> tuple[Path, list[str]] | None:
    """The gate dir and what is in it now; None where no gate is honoured or it is unreadable."""
    folder = gate_dir()
    if folder is None:
        return None
    try:
        return folder, os.listdir(folder)
    except OSError:
        return None


def _held(names: list[str], step: str, pod: str) -> bool:
    """A hold of `pod` at `step` among the gate dir's `names`: its deployment's or its own."""
    prefix = f"step.{step}."
    return f"pod.{step}.{pod}" in names or any(
        name.startswith(prefix) and pod.startswith(f"{name.removeprefix(prefix)}-")
        for name in names
    )


async def wait_at(step: str, pod: str) -> bool:
    """The worker side: wait while the harness holds `step` for this pod (its deployment, or it
    alone; never longer than HOLD_LIMIT_SECONDS); True if it waited. Async: the front door keeps
    answering."""
    listed = _listing()
    if listed is None:
        return False
    folder, names = listed
    if not _held(names, step, pod):
        return False
    at = folder / f"at.{step}.{pod}"
    tmp = folder / f".{at.name}.tmp"
    tmp.write_text(json.dumps(asdict(AtStep(pod=pod, step=step, pid=os.getpid()))))
    tmp.rename(at)
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    try:
        while time.monotonic() < deadline:
            try:
                if not _held(os.listdir(folder), step, pod):
                    break
            except OSError:
                break  # the gate dir is gone: nobody holds anything
            await asyncio.sleep(_POLL)
    finally:
        at.unlink(missing_ok=True)
    return True


def claim(pod: str) -> Claim | None:
    """Take the gate armed for this pod's deployment (pods are named `<deployment>-...`)."""
    listed = _listing()
    if listed is None:
        return None
    folder, names = listed
    for name in names:
        deployment = name.removeprefix("arm.")
        if name.startswith("arm.") and pod.startswith(f"{deployment}-"):
            try:
                os.rename(folder / name, folder / f"claimed.{pod}")
            except OSError:
                continue  # another target took it first
            return Claim(folder, deployment, pod)
    return None


# ------------------------------------------------------------------------ the harness side


def arm(folder: Path, deployment: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"arm.{deployment}").touch()


def disarm(folder: Path, deployment: str) -> None:
    """No hold left for `deployment`: the arm, a claim and any held pull released."""
    (folder / f"arm.{deployment}").unlink(missing_ok=True)
    for step in folder.glob(f"step.*.{deployment}"):
        step.unlink(missing_ok=True)
    for path in folder.glob(f"*.{deployment}-*"):
        path.unlink(missing_ok=True)


def hold_at(folder: Path, deployment: str, step: str) -> None:
    """Every pod of `deployment` that reaches `step` waits there until `release_at`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step.{step}.{deployment}").touch()


def release_at(folder: Path, deployment: str, step: str) -> None:
    (folder / f"step.{step}.{deployment}").unlink(missing_ok=True)


def hold_pod_at(folder: Path, pod: str, step: str) -> None:
    """That one pod waits at `step` (a pod of another name never does) until `release_pod_at`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"pod.{step}.{pod}").touch()


def release_pod_at(folder: Path, pod: str, step: str) -> None:
    (folder / f"pod.{step}.{pod}").unlink(missing_ok=True)


def waiting_at(folder: Path, deployment: str, step: str) -> list[AtStep]:
    """The pods of `deployment` that wait at `step` now."""
    found = []
    for path in folder.glob(f"at.{step}.{deployment}-*"):
        try:
            found.append(AtStep(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # released meanwhile
    return found


def holding(folder: Path, deployment: str) -> Held | None:
    """The pull of `deployment` that holds now, if one does."""
    for path in folder.glob(f"held.{deployment}-*"):
        try:
            return Held(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # released meanwhile
    return None


def release(folder: Path, pod: str) -> None:
    (folder / f"held.{pod}").unlink(missing_ok=True)
