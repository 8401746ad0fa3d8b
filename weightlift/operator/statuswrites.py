"""When a pass writes the status it planned: at once on a state change, coalesced otherwise.

A state change is what users and other replicas act on: the phase (with its message and the
Ready condition), a new generation observed, the model identity, the scale selector, the
replica counts (a replica Ready: what `kubectl get md`, the scale subresource and an HPA read,
and what time to Ready is measured against; serving replicas and waiting spares), and the
published sources when one is withdrawn or the first one appears (targets and sibling
deployments pull from them). Progress within a phase (`loaded`, per-replica detail, other
conditions, one more source) is written at most every STATUS_COALESCE_SECONDS: a
4-replica rollout wrote ~5 statuses, each one request and one watch event for every watcher,
where its phases are 3. Planning reads the status it planned (state.status_of), written or not,
so nothing it derives from the last status (waiting since, restarts, transition times, phase
Events) waits for a write; a pass with a write held back comes back when it is due.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

STATUS_COALESCE_SECONDS = 5.0
_STATE_FIELDS = (
    "phase",
    "message",
    "observedGeneration",
    "modelIdentity",
    "selector",
    "readyReplicas",
    "replicas",
    "spares",
)


def state_key(status: Mapping[str, Any]) -> str:
    """The parts of a status whose change is written at once (as JSON; sources by pod)."""
    ready = [c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    sources = sorted(str(s.get("pod")) for s in status.get("sources") or [])
    return json.dumps([[status.get(k) for k in _STATE_FIELDS], ready, sources])


def write_in(planned: Mapping[str, Any], written_key: str | None, since_write: float) -> float:
    """Seconds until `planned` is written: 0 on a state change against the last write
    (`written_key`, written `since_write` seconds ago), else what is left of the window."""
    if written_key is None:
        return 0.0
    fixed, ready, sources = json.loads(state_key(planned))
    was_fixed, was_ready, was_sources = json.loads(written_key)
    if (fixed, ready) != (was_fixed, was_ready):
        return 0.0
    if not set(was_sources) <= set(sources) or (sources and not was_sources):
        return 0.0  # a source withdrawn, or the first one published
    return max(0.0, STATUS_COALESCE_SECONDS - since_write)
