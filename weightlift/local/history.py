"""Every version of some API objects from a moment on, as the API server recorded them: what a
negative check reads ("it was never Ready", "readyReplicas never dropped to 0"), so that a
violation is seen however briefly it lasted, not only when it happens to fall on a poll.

`History(kube, list_method, *args, **kwargs)` LISTs once, keeps the items as the first versions,
then watches from the LIST's resourceVersion: the API server delivers every change after it, in
order, each once. A watch that ends (its server-side timeout, a dropped connection) resumes from
the last resourceVersion it delivered. A resume the API server refuses (410 Gone: that version
was compacted away) is a gap: the history says so (every wait then raises `HistoryGap`) instead
of listing again past it, which would skip what happened in between.

"During X" is bounded by an event, not a sleep: `through(obj)` waits until the history holds the
version of `obj` that a GET answered (its resourceVersion), and returns every version up to it,
so everything the API server recorded before that GET is in it. `wait(predicate)` waits for the
first version a predicate accepts (e.g. three more failed probes counted in the status).

A fence makes a known point of a moment of the caller's: a write of its own (an annotation) whose
version it waits for; every version before the fence's was recorded before that write.

The chaos bench's PodLedger (bench/chaos_failover.py) and HandoffWatch (handoffwatch.py) keep
their own list+watch loops: they note facts about pods, not versions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from weightlift.api.labels import DEPLOYMENT_LABEL
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.kube import JSON, KUBE_ERRORS, Kube, call

log = logging.getLogger("weightlift.local.history")
# A watch request's server-side timeout: the loop resumes after it, and close() waits at most
# this long for the request in flight.
WATCH_SECONDS = 5
# How often a waiter wakes without a new version (its `tick`, e.g. "is the operator alive").
TICK_SECONDS = 1.0


class HistoryGap(RuntimeError):
    """The API server could not resume the watch where it stopped: versions may be missing."""


@dataclass(frozen=True)
class Version:
    """One version of one object: LISTED (it existed when the history began), ADDED, MODIFIED or
    DELETED; `seen` is this machine's monotonic clock when it arrived."""

    type: str
    obj: JSON
    seen: float

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.obj["metadata"].get("annotations") or {})

    @property
    def spec(self) -> JSON:
        spec: JSON = self.obj.get("spec") or {}
        return spec

    @property
    def rv(self) -> str:
        return str(self.obj["metadata"]["resourceVersion"])

    @property
    def status(self) -> JSON:
        status: JSON = self.obj.get("status") or {}
        return status


class History:
    """The versions of the objects `list_method(*args, **kwargs)` lists (on its own client, made
    from `kubeconfig`), from construction on. Use as a context manager, or close()."""

    def __init__(
        self,
        kubeconfig: Path,
        list_method: Callable[[Kube], Callable[..., Any]],
        *args: Any,
        what: str = "objects",
        **kwargs: Any,
    ) -> None:
        self.kube = Kube(kubeconfig, "history")
        self.what = what
        self._method = list_method(self.kube)
        self._args, self._kwargs = args, kwargs
        self._versions: list[Version] = []
        self._gap: str | None = None
        self.requests = 0  # watch requests made (one more after each end of a watch)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        # Synchronously: whatever the caller does next happens after this resourceVersion.
        listing = call(self._method, *args, **kwargs)
        now = time.monotonic()
        self._versions = [Version("LISTED", item, now) for item in listing.get("items") or []]
        self._rv = str(listing["metadata"]["resourceVersion"])
        self._thread = threading.Thread(target=self._run, name=f"history-{what}", daemon=True)
        self._thread.start()

    # -- constructors for what the tests watch
    @classmethod
    def deployment(cls, kubeconfig: Path, namespace: str, name: str) -> History:
        """One ModelDeployment (by name: also one created after the history began)."""

        def method(kube: Kube) -> Callable[..., Any]:
            return kube.custom.list_namespaced_custom_object

        return cls(
            kubeconfig,
            method,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            what=f"ModelDeployment {namespace}/{name}",
        )

    @classmethod
    def pods(cls, kubeconfig: Path, namespace: str, deployment: str) -> History:
        """The worker pods of one ModelDeployment."""

        def method(kube: Kube) -> Callable[..., Any]:
            return kube.core.list_namespaced_pod

        return cls(
            kubeconfig,
            method,
            namespace,
            label_selector=f"{DEPLOYMENT_LABEL}={deployment}",
            what=f"pods of {namespace}/{deployment}",
        )

    # -- the watch
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch_once()
                self._stop.wait(0.05)  # a watch the API server ends at once does not spin
            except ApiException as exc:
                if exc.status == 410:
                    self._fail(f"the watch could not resume at resourceVersion {self._rv}: {exc}")
                    return
                log.debug("history of %s: %s; resuming", self.what, exc)
                self._stop.wait(0.2)
            except KUBE_ERRORS as exc:  # a dropped connection, the API server restarting
                log.debug("history of %s: %s; resuming", self.what, exc)
                self._stop.wait(0.2)
            except Exception as exc:  # nothing may end the watch silently
                self._fail(f"the watch failed: {exc!r}")
                return

    def _watch_once(self) -> None:
        self.requests += 1
        response = self._method(
            *self._args,
            watch=True,
            resource_version=self._rv,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _request_timeout=WATCH_SECONDS + 10,
            _preload_content=False,
            **self._kwargs,
        )
        try:
            status = int(getattr(response, "status", 200))
            if not 200 <= status < 300:  # a raw response: the client raised nothing
                raise ApiException(status=status, reason=str(response.data[:500]))
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    raise ApiException(status=code, reason=str(obj.get("message")))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if kind != "BOOKMARK":
                    with self._changed:
                        self._versions.append(Version(str(kind), obj, time.monotonic()))
                        self._changed.notify_all()
                if rv:
                    self._rv = str(rv)
                if self._stop.is_set():
                    return
        finally:
            response.close()
            response.release_conn()

    def _fail(self, why: str) -> None:
        with self._changed:
            self._gap = why
            self._changed.notify_all()

    # -- reading it
    def versions(self) -> list[Version]:
        with self._changed:
            return list(self._versions)

    def wait(
        self,
        predicate: Callable[[Version], bool],
        timeout: float,
        what: str,
        tick: Callable[[], None] | None = None,
    ) -> Version:
        """The first version (since the history began) that `predicate` accepts; waits for it.
        `tick()` runs at least every TICK_SECONDS (it may raise: the operator died)."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._changed:
            while True:
                for version in self._versions[checked:]:
                    if predicate(version):
                        return version
                checked = len(self._versions)
                if self._gap is not None:
                    raise HistoryGap(f"history of {self.what}: {self._gap}")
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self._versions[-1].status if self._versions else None
                    raise TimeoutError(
                        f"timed out after {timeout:.0f}s waiting for {what} in the history of "
                        f"{self.what} ({len(self._versions)} versions; the last one's status: "
                        f"{json.dumps(last)[:2000]})"
                    )
                if tick is not None:
                    self._changed.release()
                    try:
                        tick()
                    finally:
                        self._changed.acquire()
                    if len(self._versions) > checked or self._gap is not None:
                        continue
                self._changed.wait(min(TICK_SECONDS, left))

    def upto(self, version: Version) -> list[Version]:
        """Every version up to and including `version` (one this history holds)."""
        with self._changed:
            index = next(i for i, v in enumerate(self._versions) if v is version)
            return self._versions[: index + 1]

    def between(self, first: Version, last: Version) -> list[Version]:
        """The versions after `first` and before `last` (both held, `first` the earlier)."""
        return self.upto(last)[len(self.upto(first)) : -1]

    def through(
        self, obj: JSON, timeout: float = 60.0, tick: Callable[[], None] | None = None
    ) -> list[Version]:
        """Every version up to and including `obj`'s (as a GET or LIST answered it): waits until
        the watch has delivered it, so nothing recorded before that read is missing."""
        uid, rv = obj["metadata"]["uid"], obj["metadata"]["resourceVersion"]
        version = self.wait(
            lambda v: v.uid == uid and v.rv == rv, timeout, f"resourceVersion {rv}", tick
        )
        return self.upto(version)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(WATCH_SECONDS + 15)
        self.kube.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
