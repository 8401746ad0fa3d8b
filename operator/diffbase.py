"""kopf's diff base as a digest: the last-handled configuration kopf keeps in an annotation.

kopf stores the whole spec there by default. Annotations share a 256 KiB limit, so a large (but
admissible) spec made every patch of the object fail with 422 and the operator retried forever.
Our update handler only wakes the reconcile loop (it never reads the diff), so a digest per
top-level field (spec, metadata) detects a change just as well, `on.update(field="spec")` still
filters by it, and the annotation stays a few hundred bytes whatever the spec's size. (A
handler filtering on a deeper field, e.g. spec.replicas, would need that field's own digest.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, cast

import kopf


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[Any] | None = None,
    ) -> kopf.BodyEssence:
        essence = super().build(body=body, extra_fields=extra_fields)
        return cast(kopf.BodyEssence, {key: _digest(value) for key, value in essence.items()})


def _digest(value: Any) -> dict[str, str]:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {"sha256": hashlib.sha256(text.encode()).hexdigest()}
