"""The operator's /metrics, scraped for real on the process node: a deployment whose Target
waits in Standby (its source held at the fault gate until then) becomes Ready; the operator
recorded one time to Ready per replica, one standby wait and one hand-off, and counted its API
requests. A restarted operator, finding the deployment Ready, records no time to Ready again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.e2e import READY_TIMEOUT, held_source
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
Deploy = Callable[..., Observer]
Samples = list[tuple[str, dict[str, str], float]]


def scrape(stack: LocalStack, timeout: float = 30.0) -> Samples:
    """Every sample of the operator's /metrics (retried while the operator starts)."""
    url = stack.operator_metrics_url()
    assert url is not None
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = httpx.get(url, timeout=5).raise_for_status().text
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def test_operator_metrics_count_each_replica_once(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    before = scrape(stack)
    with held_source(stack, "metrics") as held:
        obs = deployments("metrics", model_dir, probe, replicas=2)
        held.pod()
        obs.wait(
            lambda o: any(r.get("phase") == "Standby" for r in o.replica_statuses()),
            READY_TIMEOUT,
            "the Target in Standby",
        )
    obs.wait_ready(READY_TIMEOUT)
    time.sleep(2.0)  # more passes: none may record a replica again
    after = scrape(stack)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    ready = "weightlift_replica_time_to_ready_seconds_count"
    assert delta(ready) == 2, [s for s in after if s[0] == ready]
    assert delta(ready, role="Source", loaded_from="storage:hostpath", engine="Builtin") == 1
    assert delta(ready, role="Target", loaded_from="peer", engine="Builtin") == 1
    assert delta("weightlift_standby_wait_seconds_count", handed="peers") == 1
    assert delta("weightlift_handoff_latency_seconds_count", handed="peers") == 1
    assert delta("weightlift_compile_cache_total", outcome="none") == 2  # a PT2 program
    assert delta("weightlift_storage_fallbacks_total") == 0
    assert total(after, "weightlift_replicas", phase="Ready") >= 2
    assert delta("weightlift_probes_total", engine="Builtin") >= 2
    assert delta("weightlift_reconcile_total", result="success") > 0
    # Our writes (pods created: 201) and kopf's watches, by the API server's own words.
    api = "weightlift_api_requests_total"
    k8s = {"client": "kubernetes"}
    assert delta(api, **k8s, verb="create", resource="pods", code="201") == 2
    assert delta(api, **k8s, verb="patch", resource="modeldeployments/status", code="200") >= 1
    assert delta(api, **k8s, verb="patch", resource="pods", code="200") >= 1  # the hand-off
    assert total(after, api, client="kopf", verb="watch", resource="pods", code="200") >= 1
    # No label names a pod, a deployment or a URI.
    for _, labels, _ in after:
        assert not any("metrics-" in v or "://" in v for v in labels.values()), labels

    # A restarted operator finds the deployment Ready: it counts the replicas, not their Ready.
    stack.restart_operator()

    def recounted() -> bool:
        samples = scrape(stack)
        return total(samples, "weightlift_replicas", phase="Ready") >= 2

    deadline = time.monotonic() + 60
    while not recounted():
        assert time.monotonic() < deadline, "the restarted operator never counted the replicas"
        time.sleep(0.5)
    restarted = scrape(stack)
    assert total(restarted, ready) == 0
    assert total(restarted, "weightlift_reconcile_total", result="success") >= 1
    obs.poll()
    assert obs.phase() == "Ready"
