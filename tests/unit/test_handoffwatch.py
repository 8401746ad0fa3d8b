"""The hand-off latency: from the peers annotation's watch event to the waiting worker's read."""

from __future__ import annotations

import threading

from weightlift.api.labels import PEERS_ANNOTATION
from weightlift.api.worker import PeerCandidate, PeerHandoff
from weightlift.local.handoffwatch import HandoffWatch, handoff_seconds


def test_latency_only_for_a_worker_that_waited_in_standby() -> None:
    worker = {"standby": 100.0, "peers": 100.25}
    assert handoff_seconds(100.1, worker) == 0.15
    # Handed before the worker waited (at creation): nothing about the node.
    assert handoff_seconds(99.0, worker) is None
    assert handoff_seconds(None, worker) is None
    assert handoff_seconds(100.1, {"peers": 100.25}) is None


def _pod(name: str, text: str | None) -> dict[str, object]:
    return {"metadata": {"name": name, "annotations": {PEERS_ANNOTATION: text} if text else {}}}


def test_the_first_given_hand_off_is_the_one_noted() -> None:
    watch = HandoffWatch.__new__(HandoffWatch)  # _note alone: no API server
    watch.handed = {}
    watch._stop = threading.Event()
    peers = PeerHandoff(peers=[PeerCandidate(pod="a", address="10.0.0.2:8000")]).to_text()
    watch._note(_pod("t", None), 1.0)
    watch._note(_pod("t", "{}"), 2.0)  # an empty hand-off: still waiting
    assert watch.handed == {}
    watch._note(_pod("t", peers), 3.0)
    watch._note(_pod("t", peers), 4.0)  # a later event of the same pod
    assert watch.handed == {"t": 3.0}
