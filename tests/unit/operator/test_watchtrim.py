"""kopf's watch stream, as the operator runs it, brings objects without metadata.managedFields
(watchtrim.py): fails when a kopf release moves the function the operator wraps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kopf._cogs.clients import watching

import weightlift.operator.handlers  # noqa: F401  (installs the trim, as the operator does)
from weightlift.operator import watchtrim


def test_the_operator_runs_kopf_watches_through_the_trim() -> None:
    assert getattr(watching.infinite_watch, "trims_managed_fields", False)
    original = watching.infinite_watch.__wrapped__  # type: ignore[attr-defined]
    assert watchtrim.install()  # a second install wraps nothing twice
    assert watching.infinite_watch.__wrapped__ is original  # type: ignore[attr-defined]


def test_events_lose_managed_fields_and_keep_everything_else() -> None:
    pod = {
        "metadata": {
            "name": "w-0",
            "labels": {"app": "x"},
            "managedFields": [{"manager": "kwok", "fieldsV1": {"f:status": {}}}],
        },
        "status": {"phase": "Running"},
    }
    events: list[Any] = [
        watching.Bookmark.LISTED,
        {"type": "MODIFIED", "object": pod},
        {"type": "ERROR", "object": {"code": 410}},
    ]

    async def inner(**kwargs: Any) -> AsyncIterator[Any]:
        assert kwargs == {"namespace": "ns"}
        for event in events:
            yield event

    async def collect() -> list[Any]:
        trimmed = watchtrim._trimmed(inner)
        return [event async for event in trimmed(namespace="ns")]

    got = asyncio.run(collect())
    assert got[0] is watching.Bookmark.LISTED
    assert got[1] == {
        "type": "MODIFIED",
        "object": {
            "metadata": {"name": "w-0", "labels": {"app": "x"}},
            "status": {"phase": "Running"},
        },
    }
    assert got[2] == {"type": "ERROR", "object": {"code": 410}}
