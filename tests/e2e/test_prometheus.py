"""A real Prometheus (local/prometheus.py, built by `make prometheus`) scrapes the local stack
through Kubernetes service discovery, as a platform team's does: the chart's operator pods behind
its metrics Service, and the worker pods. After a demo-sized deployment (builtin runtime, a small
PT2 model, 3 replicas) PromQL says: the time-to-Ready histogram has one sample per replica, every
worker loaded the model's bytes, and every panel query of the chart's Grafana dashboard returns
data. One stack (the chart installed with helm) and one Prometheus for the module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import _require_binaries
from tests.support.e2e import READY_TIMEOUT, alive
from tests.support.promchecks import (
    Deployed,
    check_dashboard,
    check_loaded_bytes,
    check_service_discovery,
    check_time_to_ready,
)
from weightlift.local.observe import Observer
from weightlift.local.prometheus import (
    LocalPrometheus,
    PrometheusError,
    prometheus_path,
)
from weightlift.local.stack import LocalStack, make_demo_model, model_deployment

JSON = dict[str, Any]
NAME = "demo"
REPLICAS = 3
MODEL_MB = 8.0

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


@pytest.fixture(scope="module")
def deployed(stack: LocalStack, prom: LocalPrometheus, root: Path) -> Deployed:
    model_dir = root / "models" / NAME
    probe = make_demo_model(model_dir, MODEL_MB)
    applied_at = time.time()
    stack.apply(model_deployment(NAME, model_dir, replicas=REPLICAS, probe=probe))
    obs = Observer(stack, NAME)
    obs.wait_ready(READY_TIMEOUT)
    return Deployed(obs, model_dir, applied_at, NAME, REPLICAS, MODEL_MB)


def test_service_discovery_finds_the_operator_pods_and_every_worker(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    check_service_discovery(stack, prom, deployed)


def test_time_to_ready_has_one_sample_per_replica(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    check_time_to_ready(stack, prom, deployed)


def test_each_worker_loaded_the_models_bytes(
    stack: LocalStack, prom: LocalPrometheus, deployed: Deployed
) -> None:
    check_loaded_bytes(stack, prom, deployed)


def test_every_dashboard_panel_query_returns_data(
    prom: LocalPrometheus, deployed: Deployed
) -> None:
    check_dashboard(prom, deployed)
