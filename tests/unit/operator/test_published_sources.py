"""What a ModelDeployment publishes as sources for other deployments of its model: its
status.sources, and nothing once it is being deleted (its finalizer keeps the object and its
last status until its pods are gone; a new deployment must not be handed a source on its way
out). Both readers use it: kopf's index and the sources LIST before a storage load."""

from __future__ import annotations

from typing import Any

import kopf

from weightlift.operator.handlers import published_sources
from weightlift.operator.reconcile import published_by

SOURCE = {"pod": "a-0", "deployment": "a", "address": "10.0.0.5:8000", "modelIdentity": "m1"}


def md(deleting: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "a", "namespace": "ns", "finalizers": ["kopf"]}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T15:52:00Z"
    return {"metadata": meta, "status": {"sources": [SOURCE]}}


def test_a_deployment_publishes_its_sources_until_it_is_being_deleted() -> None:
    assert published_by(md(deleting=False)) == [SOURCE]
    assert published_by(md(deleting=True)) == []
    assert published_by({"metadata": {}}) == []


async def test_the_index_drops_a_deployment_being_deleted() -> None:
    live = await published_sources(namespace="ns", body=kopf.Body(md(deleting=False)))
    assert live == {("ns", "m1"): [SOURCE]}
    assert await published_sources(namespace="ns", body=kopf.Body(md(deleting=True))) == {}
