"""Every change the API server makes to some objects, as watch events, in order: negative checks
("nothing was created meanwhile") count events between two known points instead of comparing
two samples, which miss whatever came and went between them.

A known point is a fence: a write of our own whose event we wait for. A watch delivers one
resource's events in resourceVersion order, so once the fence's event is here, every change
made before the fence's write is here too."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kubernetes import watch

# A watch request's server-side bound: the thread re-watches from the last resourceVersion.
_REWATCH_SECONDS = 30


@dataclass(frozen=True)
class Change:
    """One watch event: ADDED, MODIFIED or DELETED, and the object as the API server sent it."""

    type: str
    obj: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.obj["metadata"].get("annotations") or {})

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.obj.get("spec") or {})


class Watched:
    """The events of `list_call(*args, **kwargs)` from the moment it was made, gathered by a
    thread. `list_call` is a kubernetes client list method (label and field selectors go in
    kwargs)."""

    def __init__(self, list_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._call, self._args, self._kwargs = list_call, args, kwargs
        listed = list_call(*args, _preload_content=False, **kwargs)
        self.listed: list[dict[str, Any]] = json.loads(listed.data)["items"]
        self._version = str(json.loads(listed.data)["metadata"]["resourceVersion"])
        self._changes: list[Change] = []
        self._error: BaseException | None = None
        self._more = threading.Condition()
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name="watched", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._watch = watch.Watch()
                stream = self._watch.stream(
                    self._call,
                    *self._args,
                    resource_version=self._version,
                    timeout_seconds=_REWATCH_SECONDS,
                    allow_watch_bookmarks=True,
                    deserialize=False,
                    **self._kwargs,
                )
                for event in stream:
                    obj = event["object"]
                    self._version = str(obj["metadata"]["resourceVersion"])
                    if event["type"] == "BOOKMARK":
                        continue
                    with self._more:
                        self._changes.append(Change(str(event["type"]), obj))
                        self._more.notify_all()
        except BaseException as exc:  # a 410 (history compacted) or a broken watch: say so
            if not self._stopped.is_set():
                with self._more:
                    self._error = exc
                    self._more.notify_all()

    def changes(self) -> list[Change]:
        with self._more:
            if self._error is not None:
                raise AssertionError(f"the watch broke: {self._error!r}")
            return list(self._changes)

    def wait(self, found: Callable[[Change], bool], timeout: float, what: str) -> int:
        """The index (in `changes()`) of the first event `found` accepts, once it has come."""
        deadline = time.monotonic() + timeout
        with self._more:
            while True:
                if self._error is not None:
                    raise AssertionError(f"the watch broke waiting for {what}: {self._error!r}")
                for i, change in enumerate(self._changes):
                    if found(change):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(c.type, c.name) for c in self._changes[-10:]]
                    raise AssertionError(f"no event of {what} in {timeout:.0f}s (last: {seen})")
                self._more.wait(left)

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=10)


@contextmanager
def watched(list_call: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[Watched]:
    w = Watched(list_call, *args, **kwargs)
    try:
        yield w
    finally:
        w.stop()
