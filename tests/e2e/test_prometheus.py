"""A real Prometheus (local/prometheus.py, built by `make prometheus`) scrapes the local stack
through Kubernetes service discovery, as a platform team's does: the chart's operator pods behind
its metrics Service, and the worker pods. After a demo-sized deployment (builtin runtime, a small
PT2 model, 3 replicas) PromQL says: the time-to-Ready histogram has one sample per replica, every
worker loaded the model's bytes, and every panel query of the chart's Grafana dashboard returns
data. One stack (the chart installed with helm) and one Prometheus for the module.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import _require_binaries
from tests.support.e2e import READY_TIMEOUT, alive
from weightlift.local.observe import Observer
from weightlift.local.prometheus import (
    WORKER_JOB,
    LocalPrometheus,
    PrometheusError,
    prometheus_path,
)
from weightlift.local.release import CHART
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

JSON = dict[str, Any]
NAME = "demo"
REPLICAS = 3
MODEL_MB = 8.0
DASHBOARD = CHART / "dashboards" / "weightlift-operator.json"
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval).
RATE_INTERVAL = "4s"
SCRAPE_WAIT = 20.0  # seconds for a value to reach Prometheus (scrapes every 1 s; a loaded box)

pytestmark = pytest.mark.timeout(900)


def _require_prometheus() -> None:
    try:
        prometheus_path()
    except PrometheusError as exc:
        if os.environ.get("WEIGHTLIFT_REQUIRE_CLUSTER"):
            pytest.fail(f"{exc} [WEIGHTLIFT_REQUIRE_CLUSTER is set]", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prometheus")


@pytest.fixture(scope="module")
def stack(root: Path) -> Iterator[LocalStack]:
    _require_binaries()
    _require_prometheus()
    (root / "models").mkdir()
    s = LocalStack(
        root / "stack",
        node_name="prom-node",
        install="helm",  # the operator as the chart's pods, behind its metrics Service
        model_path_prefixes=(str(root / "models"),),
        worker_env={"CUDA_VISIBLE_DEVICES": ""},
    )
    with s:
        yield s


@pytest.fixture(scope="module")
def prom(stack: LocalStack, root: Path) -> Iterator[LocalPrometheus]:
    p = LocalPrometheus(stack, root / "prometheus")
    with p:
        assert p.proc is not None
        pid = p.proc.pid
        yield p
    assert not alive(pid), f"prometheus {pid} left running"


@dataclass(frozen=True)
class Deployed:
    obs: Observer
    model_dir: Path
    applied_at: float  # wall clock, as Prometheus' timestamps


@pytest.fixture(scope="module")
def deployed(stack: LocalStack, prom: LocalPrometheus, root: Path) -> Deployed:
    model_dir = root / "models" / NAME
    probe = make_demo_model(model_dir, MODEL_MB)
    applied_at = time.time()
    stack.apply(model_deployment(NAME, model_dir, replicas=REPLICAS, probe=probe))
    obs = Observer(stack, NAME)
    obs.wait_ready(READY_TIMEOUT)
    return Deployed(obs, model_dir, applied_at)


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


def test_service_discovery_finds_the_operator_pods_and_every_worker(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    assert stack.release is not None
    operator_pods = {p["metadata"]["name"]: p for p in stack.release.live_operator_pods()}
    workers = {p["metadata"]["name"]: p for p in stack.pods(NAME)}
    assert len(workers) == REPLICAS

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
        assert labels["job"] == WORKER_JOB and labels["deployment"] == NAME
        assert labels["instance"] == f"{pod['status']['podIP']}:{port}"


def test_time_to_ready_has_one_sample_per_replica(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    count = "weightlift_replica_time_to_ready_seconds_count"

    def total() -> float | None:
        got = values(prom.query(f"sum({count})"))
        return next(iter(got.values()), None) if got else None

    eventually(prom, "a time to Ready per replica", lambda: total() == REPLICAS)
    # By role: one Source loaded from storage, the Targets from it; one operator recorded them.
    by_role = values(prom.query(f"sum by (role, loaded_from) ({count})"))
    assert by_role == {
        json.dumps({"loaded_from": "storage:hostpath", "role": "Source"}): 1.0,
        json.dumps({"loaded_from": "peer", "role": "Target"}): REPLICAS - 1.0,
    }
    assert stack.release is not None
    leader = stack.release.operator_pod()
    assert leader is not None
    # Both series from the operator pod that holds the Lease; the standby recorded none.
    assert values(prom.query(f"count by (pod) ({count} > 0)")) == {leader["metadata"]["name"]: 2}
    observed = values(prom.query(f"sum({count.replace('_count', '_sum')})"))
    elapsed = time.time() - deployed.applied_at
    assert 0 < next(iter(observed.values())) < REPLICAS * elapsed


def test_each_worker_loaded_the_models_bytes(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    size = model_bytes(deployed.model_dir)
    assert size > MODEL_MB * 1e6 * 0.9, size  # the demo model's weights, not a header
    pods = {p["metadata"]["name"] for p in stack.pods(NAME)}
    query = f'weightlift_bytes_loaded{{job="{WORKER_JOB}", deployment="{NAME}"}}'

    def loaded() -> dict[str, float]:
        got = values(prom.query(query))
        return got if set(got) == pods and set(got.values()) == {float(size)} else {}

    eventually(prom, f"weightlift_bytes_loaded = {size} on {sorted(pods)}", loaded)
    totals = values(prom.query(query.replace("bytes_loaded", "bytes_total")))
    assert totals == dict.fromkeys(pods, float(size))


def test_every_dashboard_panel_query_returns_data(
    prom: LocalPrometheus, deployed: Deployed
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    # Template variables as Grafana resolves them: $job from its own query (label_values),
    # all values selected; $__range the dashboard's time range (the deployment's life here).
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variables["job"]["definition"])
    assert match, variables["job"]
    jobs = eventually(prom, "the $job variable", lambda: prom.label_values(match[2], match[1]))
    time.sleep(2 * 4)  # a few more scrapes: rate() windows of RATE_INTERVAL after Ready
    end = time.time()
    span = math.ceil(end - deployed.applied_at)
    subst = {
        "$__rate_interval": RATE_INTERVAL,
        "$__range": f"{span}s",
        "$job": "(" + "|".join(grafana_regex_escape(j) for j in jobs) + ")",
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
        if not finite:
            empty.append(f"{title}: {query} -> {series}")
        last.setdefault(title, sum(float(s["values"][-1][1]) for s in series))
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # Counted over the range from 0, also for series born in it (replicas Ready in one pass).
    assert last["Replicas Ready"] == REPLICAS
    assert last["Compile cache"] == REPLICAS  # one outcome (none: a PT2 program) per replica
    assert last["Storage fallbacks by reason"] == 0
