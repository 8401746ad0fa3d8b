"""When the operator handed each pod its peers: a pod watch that notes, on this machine's clock,
the first event whose weightlift.dev/peers annotation names peers or storage.

The worker notes (its timeline's `peers`) when it read the same hand-off from its downwardAPI
file; the difference is the hand-off latency the node gives (the kubelet rewrites the file on
the pod-update event; the process node polls). Same machine, same clock. The watch's own delivery
(milliseconds) is inside the measured span, so the figure is a slight overestimate of what the
annotation patch leaves to the node, never an underestimate of it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from kubernetes import watch

from weightlift.api.labels import DEPLOYMENT_LABEL, PEERS_ANNOTATION
from weightlift.api.worker import PeerHandoff
from weightlift.local.kube import KUBE_ERRORS, Kube

log = logging.getLogger("weightlift.demo")
# A watch request's server-side timeout: the loop re-watches, and a stop waits at most this.
WATCH_SECONDS = 5


class HandoffWatch:
    """pod name -> wall time its hand-off first showed in a watch event. Start before the apply."""

    def __init__(self, kube: Kube, namespace: str, deployment: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = f"{DEPLOYMENT_LABEL}={deployment}"
        self.handed: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handoff-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.kube.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    timeout_seconds=WATCH_SECONDS,
                    _request_timeout=WATCH_SECONDS + 10,
                ):
                    seen = time.time()
                    self._note(event.get("raw_object") or {}, seen)
                    if self._stop.is_set():
                        w.stop()
            except KUBE_ERRORS as exc:  # the API server restarting: watch again
                log.debug("hand-off watch: %s", exc)
                self._stop.wait(0.2)

    def _note(self, pod: dict[str, object], seen: float) -> None:
        meta = pod.get("metadata")
        if not isinstance(meta, dict):
            return
        name = str(meta.get("name", ""))
        annotations = meta.get("annotations") or {}
        handoff = PeerHandoff.parse(annotations.get(PEERS_ANNOTATION))
        if name and handoff is not None and handoff.given:
            self.handed.setdefault(name, seen)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(WATCH_SECONDS + 15)


def handoff_seconds(handed: float | None, worker: dict[str, float]) -> float | None:
    """Seconds from the hand-off's watch event to the worker reading it, for a worker that was
    waiting in Standby when it was handed (a hand-off present at the pod's creation says nothing
    about the node)."""
    standby, read = worker.get("standby"), worker.get("peers")
    if handed is None or standby is None or read is None or handed < standby:
        return None
    return round(read - handed, 3)
