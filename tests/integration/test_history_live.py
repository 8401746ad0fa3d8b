"""local/history.py against a real API server: every version of an object, in order, none
skipped however fast they come, across the watch's own ends (it resumes where it stopped); and
`through` returns exactly the versions up to the one a GET answered. (A resume the API server
refuses, 410 Gone, needs a compacted etcd: tests/unit/local/test_history.py fakes it.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from tests.support.cluster import wait_for
from weightlift.local import history as history_module
from weightlift.local.cluster import ClusterInfo
from weightlift.local.history import History
from weightlift.local.kube import MERGE, Kube, call

WRITES = 40


def _configmaps(kube: Kube) -> Callable[..., Any]:
    return kube.core.list_namespaced_config_map


def test_every_version_in_order_across_watch_ends(
    cluster: ClusterInfo,
    core: client.CoreV1Api,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(history_module, "WATCH_SECONDS", 1)  # the watch ends every second
    name = f"h-{uuid.uuid4().hex[:8]}"
    core.create_namespaced_config_map(namespace, {"metadata": {"name": name}, "data": {"n": "-1"}})
    with History(
        cluster.kubeconfig,
        _configmaps,
        namespace,
        field_selector=f"metadata.name={name}",
        what=f"ConfigMap {name}",
    ) as history:
        # Back to back, far faster than anyone polls: each write a version.
        for n in range(WRITES):
            call(
                core.patch_namespaced_config_map,
                name,
                namespace,
                {"data": {"n": str(n)}},
                _content_type=MERGE,
            )
        # Then more after the watch has ended and resumed at least twice.
        requests = history.requests
        wait_for(lambda: history.requests >= requests + 2, 30, "the watch to resume twice")
        call(core.patch_namespaced_config_map, name, namespace, {"data": {"n": str(WRITES)}},
             _content_type=MERGE)  # fmt: skip
        last = call(core.read_namespaced_config_map, name, namespace)
        versions = history.through(last, timeout=30)
    seen = [int(v.obj["data"]["n"]) for v in versions]
    assert seen == list(range(-1, WRITES + 1)), seen
    assert [v.type for v in versions] == ["LISTED"] + ["MODIFIED"] * (WRITES + 1)
    assert versions[-1].rv == last["metadata"]["resourceVersion"]
