"""No diff base: the operator has no handler that needs one.

kopf keeps the last-handled configuration of an object in an annotation for its change handlers
(on.create, on.update, ...) and writes it back on each handled change: one more patch per
ModelDeployment at creation, each coming back through the watch, and a deep copy of the body on
every event to compare with it. The operator's handlers are a daemon, watching handlers and the
deletion handler (its cause comes from deletionTimestamp, not from a diff); a spec change is
seen by its generation (handlers.generation_changed). With an empty essence stored nowhere, kopf
finds no change on any event and patches nothing.

(Before 2026-11-25 a digest of the spec was kept there for an on.update(field="spec") handler; a
spec of any size needs no annotation now either.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf


class NoDiffBaseStorage(kopf.DiffBaseStorage):
    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[Any] | None = None,
    ) -> kopf.BodyEssence:
        return cast(kopf.BodyEssence, {})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return cast(kopf.BodyEssence, {})  # not None: None would read as a creation

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None
