"""A hold a live test puts on one reconcile's pod creations, so it can kill the operator
between two of them.

A pass creates its pods at once (reconcile._create_pods): a test that polls for "the first pod
exists" to SIGKILL the operator mid-reconcile strikes whenever its poll fires, and on a fast
machine every pod exists by then. Instead the test arms this gate before it creates the
ModelDeployment: the next pass of that deployment that creates two pods or more creates the
first alone, writes `held.<deployment>` (JSON `Held`) and waits, without blocking the event
loop, until the test deletes the file; then it creates the rest.

Off unless $WEIGHTLIFT_OPERATOR_GATE_DIR names the gate dir, and never in a pod: the kubelet
sets $KUBERNETES_SERVICE_HOST in every container and the in-cluster operator reaches the API
server through it, so an operator the chart runs cannot take a hold whatever its extraEnv says.
A hold never outlives HOLD_LIMIT_SECONDS (a test that died never wedges a pass). Stdlib only.
Files in the gate dir:
    arm.<deployment>   armed by the test: one hold, for that deployment's next such pass
    held.<deployment>  written once the first pod exists; deleting it releases the pass
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GATE_DIR_ENV = "WEIGHTLIFT_OPERATOR_GATE_DIR"
IN_POD_ENV = "KUBERNETES_SERVICE_HOST"
HOLD_LIMIT_SECONDS = 300.0
_POLL = 0.02


@dataclass(frozen=True)
class Held:
    """Where the held pass stands: `created` exist, `pending` are still to be created."""

    deployment: str
    pid: int
    created: list[str]
    pending: list[str]


def gate_dir() -> Path | None:
    """The gate dir, outside a pod only."""
    where = os.environ.get(GATE_DIR_ENV)
    if not where or os.environ.get(IN_POD_ENV):
        return None
    return Path(where)


def claim(deployment: str) -> Path | None:
    """Take the hold armed for `deployment` (an unlink: one pass wins); the gate dir if taken."""
    folder = gate_dir()
    if folder is None:
        return None
    try:
        (folder / f"arm.{deployment}").unlink()
    except OSError:
        return None  # not armed (or not for this deployment)
    return folder


async def hold(folder: Path, held: Held) -> None:
    """Say where the pass stands, then wait until the file is deleted (or the limit passes)."""
    path = folder / f"held.{held.deployment}"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(json.dumps(asdict(held)))
    tmp.rename(path)  # the test never reads a half-written file
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while path.exists() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL)
    path.unlink(missing_ok=True)


# ------------------------------------------------------------------------ the test's side


def arm(folder: Path, deployment: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"arm.{deployment}").touch()


def holding(folder: Path, deployment: str) -> Held | None:
    """The held pass of `deployment`, if one holds now."""
    try:
        return Held(**json.loads((folder / f"held.{deployment}").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def release(folder: Path, deployment: str) -> None:
    (folder / f"held.{deployment}").unlink(missing_ok=True)
