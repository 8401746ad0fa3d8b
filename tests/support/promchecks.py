"""PromQL checks of a stack a real Prometheus scrapes (local/prometheus.py), shared by the
process node's module (tests/e2e/test_prometheus.py) and the real node's
(tests/e2e/test_kubelet_lifecycle.py, where Prometheus is a pod): service discovery finds the
chart's operator pods and every worker, the time-to-Ready histogram has one sample per replica,
every worker loaded the model's bytes, and every panel query of the shipped dashboard returns
data (a panel of an engine's series, such as vLLM's, where the deployment runs that engine)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightlift.local.observe import Observer
from weightlift.local.prometheus import WORKER_JOB, LocalPrometheus
from weightlift.local.release import CHART
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
DASHBOARD = CHART / "dashboards" / "weightlift-operator.json"
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval).
RATE_INTERVAL = "4s"
# Seconds for a value to reach Prometheus: it scrapes every 1 s, but on a loaded 2-core machine
# discovery, a scrape (each with a 1 s timeout) and the TSDB's append can each fall behind by
# many seconds. A bound on a wait for something that comes, never a speed check: generous.
SCRAPE_WAIT = 120.0
# Scrapes of each target after Ready before the dashboard's range ends: two rate() windows
# (RATE_INTERVAL) of the 1 s scrape interval, counted in Prometheus' own `up` series.
SCRAPES_AFTER_READY = 8
# Panels of an engine's own series (the workers re-export them) have data only where replicas
# run that engine: on another run their queries still go to Prometheus, which parses and runs
# each, but an empty answer is allowed. By runtime.engine.
ENGINE_SERIES = {"vLLM": re.compile(r"(?<![\w:])vllm:")}


@dataclass(frozen=True)
class Deployed:
    obs: Observer
    model_dir: Path
    applied_at: float  # wall clock, as Prometheus' timestamps
    name: str
    replicas: int
    model_mb: float
    engine: str = "Builtin"  # runtime.engine of its replicas


def eventually(prom: LocalPrometheus, what: str, check: Callable[[], Any]) -> Any:
    """`check()` until it returns a truthy value; its last answer in the failure otherwise."""
    deadline = time.monotonic() + SCRAPE_WAIT
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: last answer {got!r}\n{prom.log_tail(10)}")
        time.sleep(0.5)


def values(result: list[JSON]) -> dict[str, float]:
    """An instant vector as {pod (or the whole label set): value}."""
    return {
        r["metric"].get("pod") or json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
        for r in result
    }


def grafana_regex_escape(value: str) -> str:
    """A multi-value variable's value inside `=~"..."`, escaped as Grafana's Prometheus data
    source does (regex metacharacters, backslash doubled for the PromQL string)."""
    return re.sub(r"([\\$^*+?.()|{}\[\]])", r"\\\\\1", value)


def model_bytes(model_dir: Path) -> int:
    """The tensor bytes of the model's safetensors files, from their headers (8-byte length,
    JSON with each tensor's data_offsets), read here independently of the worker's code."""
    total = 0
    for path in sorted(model_dir.rglob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for k, v in header.items() if k != "__metadata__"
                     for start, end in [v["data_offsets"]])  # fmt: skip
    return total


def check_service_discovery(stack: LocalStack, prom: LocalPrometheus, deployed: Deployed) -> None:
    assert stack.release is not None
    operator_pods = {p["metadata"]["name"]: p for p in stack.release.live_operator_pods()}
    workers = {p["metadata"]["name"]: p for p in stack.pods(deployed.name)}
    assert len(workers) == deployed.replicas

    def up() -> dict[str, JSON]:
        return {t["labels"].get("pod", ""): t for t in prom.targets() if t["health"] == "up"}

    def all_up() -> dict[str, JSON]:
        got = up()
        return got if set(operator_pods) | set(workers) <= set(got) else {}

    targets = eventually(prom, "every operator pod and worker scraped", all_up)
    for name, pod in {**operator_pods, **workers}.items():
        # The pod's own address (127.0.x.y on the process node), as discovery found it.
        assert targets[name]["labels"]["instance"].split(":")[0] == pod["status"]["podIP"]
    for name in operator_pods:  # as a ServiceMonitor's targets are labelled
        labels = targets[name]["labels"]
        assert labels["job"] == labels["service"] == f"{stack.release.fullname}-metrics"
        assert labels["endpoint"] == "metrics" and labels["namespace"] == stack.release.namespace
    for name, pod in workers.items():
        labels = targets[name]["labels"]
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert labels["job"] == WORKER_JOB and labels["deployment"] == deployed.name
        assert labels["instance"] == f"{pod['status']['podIP']}:{port}"


def check_time_to_ready(stack: LocalStack, prom: LocalPrometheus, deployed: Deployed) -> None:
    count = "weightlift_replica_time_to_ready_seconds_count"

    def total() -> float | None:
        got = values(prom.query(f"sum({count})"))
        return next(iter(got.values()), None) if got else None

    eventually(prom, "a time to Ready per replica", lambda: total() == deployed.replicas)
    # By role: one Source loaded from storage, the Targets from it; one operator recorded them.
    by_role = values(prom.query(f"sum by (role, loaded_from) ({count})"))
    assert by_role == {
        json.dumps({"loaded_from": "storage:hostpath", "role": "Source"}): 1.0,
        json.dumps({"loaded_from": "peer", "role": "Target"}): deployed.replicas - 1.0,
    }
    assert stack.release is not None
    leader = stack.release.operator_pod()
    assert leader is not None
    # Both series from the operator pod that holds the Lease; the standby recorded none.
    assert values(prom.query(f"count by (pod) ({count} > 0)")) == {leader["metadata"]["name"]: 2}
    observed = values(prom.query(f"sum({count.replace('_count', '_sum')})"))
    # A pod's creationTimestamp is whole seconds, rounded down: a replica's time to Ready may
    # exceed the wall time since the apply by up to a second.
    elapsed = time.time() - deployed.applied_at + 1.0
    assert 0 < next(iter(observed.values())) < deployed.replicas * elapsed


def check_loaded_bytes(stack: LocalStack, prom: LocalPrometheus, deployed: Deployed) -> None:
    size = model_bytes(deployed.model_dir)
    assert size > deployed.model_mb * 1e6 * 0.9, size  # the demo model's weights, not a header
    pods = {p["metadata"]["name"] for p in stack.pods(deployed.name)}
    query = f'weightlift_bytes_loaded{{job="{WORKER_JOB}", deployment="{deployed.name}"}}'

    def loaded() -> dict[str, float]:
        got = values(prom.query(query))
        return got if set(got) == pods and set(got.values()) == {float(size)} else {}

    eventually(prom, f"weightlift_bytes_loaded = {size} on {sorted(pods)}", loaded)
    totals = values(prom.query(query.replace("bytes_loaded", "bytes_total")))
    assert totals == dict.fromkeys(pods, float(size))


def scraped_since(prom: LocalPrometheus, deployed: Deployed, job_regex: str, ready: float) -> float:
    """Until Prometheus has recorded SCRAPES_AFTER_READY successful scrapes since `ready` (wall
    clock, after the deployment was Ready) of the operator pod that leads, whose series every
    panel reads, in its own `up` series: rate() windows after Ready have samples however slowly
    the scrapes came. Returns the moment that was seen (the dashboard range's end)."""
    stack = deployed.obs.stack
    assert stack.release is not None
    leader = stack.release.operator_pod()
    assert leader is not None
    want = {leader["metadata"]["name"]}
    deadline = time.monotonic() + SCRAPE_WAIT
    while True:
        now = time.time()
        # The window (now - seconds, now] starts after `ready`: only scrapes after it count.
        seconds = int(now - ready)
        query = f'sum_over_time(up{{job=~"{job_regex}"}}[{seconds}s])'
        got = values(prom.query(query, at=now)) if seconds >= 1 else {}
        short = {pod: got.get(pod, 0.0) for pod in want if got.get(pod, 0.0) < SCRAPES_AFTER_READY}
        if not short:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(
                f"fewer than {SCRAPES_AFTER_READY} successful scrapes in the {seconds} s after "
                f"Ready (pod: scrapes): {short}\n{prom.log_tail(10)}"
            )
        time.sleep(0.5)


def check_dashboard(prom: LocalPrometheus, deployed: Deployed) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    # Template variables as Grafana resolves them: $job from its own query (label_values),
    # all values selected; $__range the dashboard's time range (the deployment's life here).
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variables["job"]["definition"])
    assert match, variables["job"]
    jobs = eventually(prom, "the $job variable", lambda: prom.label_values(match[2], match[1]))
    job_regex = "(" + "|".join(grafana_regex_escape(j) for j in jobs) + ")"
    end = scraped_since(prom, deployed, job_regex, time.time())
    span = math.ceil(end - deployed.applied_at)
    subst = {
        "$__rate_interval": RATE_INTERVAL,
        "$__range": f"{span}s",
        "$job": job_regex,
    }
    exprs = [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    assert len(exprs) >= 10, exprs
    empty = []
    last: dict[str, float] = {}  # title -> its first query's series summed at the range's end
    for title, expr in exprs:
        query = expr
        for var, value in subst.items():
            query = query.replace(var, value)
        assert "$" not in query, f"{title}: unsubstituted variable in {query}"
        series = prom.query_range(query, deployed.applied_at, end, 1.0)
        finite = [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]
        engines = {e for e, names in ENGINE_SERIES.items() if names.search(query)}
        if not finite and (not engines or deployed.engine in engines):
            empty.append(f"{title}: {query} -> {series}")
        last.setdefault(title, sum(float(s["values"][-1][1]) for s in series))
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # Counted over the range from 0, also for series born in it (replicas Ready in one pass).
    assert last["Replicas Ready"] == deployed.replicas
    assert (
        last["Compile cache"] == deployed.replicas
    )  # one outcome (none: a PT2 program) per replica
    assert last["Storage fallbacks by reason"] == 0
