"""kopf's diff base as a digest: the last-handled configuration kopf keeps in an annotation.

kopf stores the whole spec there by default. Annotations share a 256 KiB limit, so a large (but
admissible) spec made every patch of the object fail with 422 and the operator retried forever.
Our update handler only wakes the reconcile loop (it never reads the diff), so a digest of the
spec detects a change just as well, `on.update(field="spec")` still filters by it, and the
annotation stays a few hundred bytes whatever the spec's size. (A handler filtering on a deeper
field, e.g. spec.replicas, would need that field's own digest.)

Only the spec (and any field a handler names outside it): kopf's essence also holds labels and
annotations, so the operator's own `sources-of` label made kopf patch its diff base once more
per deployment (and deep-copy the whole body, status included, on every event to find out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, cast

import kopf
from kopf._cogs.structs import dicts  # kopf's own field paths (not re-exported)


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[Any] | None = None,
    ) -> kopf.BodyEssence:
        essence: dict[str, Any] = {}
        if body.get("spec") is not None:
            essence["spec"] = _digest(body["spec"])
        for field in extra_fields or ():
            path = dicts.parse_field(field)
            value = dicts.resolve(body, path, None)
            if path and path[0] != "spec" and value is not None:
                parent = essence
                for key in path[:-1]:
                    parent = parent.setdefault(key, {})
                parent[path[-1]] = _digest(value)
        return cast(kopf.BodyEssence, essence)


def _digest(value: Any) -> dict[str, str]:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {"sha256": hashlib.sha256(text.encode()).hexdigest()}
