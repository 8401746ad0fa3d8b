"""The operator's /metrics, scraped for real on the process node: a deployment whose Target
waits in Standby (its source held at the fault gate until then) becomes Ready; the operator
recorded one time to Ready per replica, one standby wait and one hand-off, and counted its API
requests. A restarted operator, finding the deployment Ready, records no time to Ready again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.e2e import READY_TIMEOUT, held_source
from tests.support.opmetrics import passes, scrape, total, wait_no_deployments, wait_passes
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


def test_operator_metrics_count_each_replica_once(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    # An earlier test's deployment, deleted, may still be in the operator's index a moment.
    before = wait_no_deployments(stack)
    with held_source(stack, "metrics") as held:
        obs = deployments("metrics", model_dir, probe, replicas=2)
        held.pod()
        obs.wait(
            lambda o: any(r.get("phase") == "Standby" for r in o.replica_statuses()),
            READY_TIMEOUT,
            "the Target in Standby",
        )
    obs.wait_ready(READY_TIMEOUT)
    # None of the passes after Ready may record a replica again: the counters, read once the
    # operator counts 3 more successful passes than when the deployment was Ready, hold
    # everything those passes recorded.
    after = wait_passes(stack, passes(scrape(stack)) + 3, "3 passes after Ready")
    assert total(after, "weightlift_deployments") == 1, "the passes counted are not all ours"

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

    # Its counters start at 0 with the process: read after its 3rd successful pass, they hold
    # whatever its first 3 passes recorded (not only its first).
    restarted = wait_passes(stack, 3, "the restarted operator's passes")
    assert total(restarted, "weightlift_replicas", phase="Ready") >= 2
    assert total(restarted, ready) == 0, [s for s in restarted if s[0] == ready]
    assert total(restarted, "weightlift_reconcile_total", result="success") >= 1
    obs.poll()
    assert obs.phase() == "Ready"
