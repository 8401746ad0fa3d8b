"""The operator's own /metrics, read by the e2e tests: its counters are records, not samples. A
counter read at a moment holds everything the process counted before it, so "the operator did
not record X" is checked by reading X's counter after the operator proved, by its own pass
counter, that it had its chances to."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.e2e import READY_TIMEOUT
from weightlift.local.stack import LocalStack

Samples = list[tuple[str, dict[str, str], float]]
PASSES = "weightlift_reconcile_total"
# A restarted or rolled operator imports kopf, the kubernetes client and pydantic before it
# serves /metrics: seconds when idle, far more on a loaded 2-core machine. A bound on a wait for
# something that comes, never a speed check.
START_TIMEOUT = 120.0


def scrape(stack: LocalStack, timeout: float = START_TIMEOUT) -> Samples:
    """Every sample of the (leading) operator's /metrics (retried while the operator starts)."""
    deadline = time.monotonic() + timeout
    while True:
        url = stack.operator_metrics_url()
        try:
            if url is None:
                raise httpx.ConnectError("no operator pod address yet")
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


def passes(samples: Samples) -> float:
    """The operator process's successful reconcile passes so far."""
    return total(samples, PASSES, result="success")


def wait_passes(
    stack: LocalStack, at_least: float, what: str, timeout: float = READY_TIMEOUT
) -> Samples:
    """Scrapes until the operator counts `at_least` successful passes; that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        stack.check_operator()
        samples = scrape(stack)
        if passes(samples) >= at_least:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: the operator counts {passes(samples):.0f} successful passes, "
                f"not {at_least:.0f}, after {timeout:.0f}s"
            )
        time.sleep(0.5)


def wait_no_deployments(stack: LocalStack, timeout: float = READY_TIMEOUT) -> Samples:
    """Scrapes until the operator tracks no deployment (an earlier test's, deleted, forgotten by
    its index): counters read from then on are only the next deployment's."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(stack)
        if total(samples, "weightlift_deployments") == 0:
            return samples
        if time.monotonic() > deadline:
            counted = {lab["phase"]: v for n, lab, v in samples if n == "weightlift_deployments"}
            raise AssertionError(
                f"the operator still counts deployments after {timeout:.0f}s: {counted}"
            )
        time.sleep(0.5)
