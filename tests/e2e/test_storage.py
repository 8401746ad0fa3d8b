"""The demo model from s3:// (MinIO on loopback, credentials in a Secret) and from pvc:// (a PVC
bound to a hostPath PV by the real PV controller) reaches Ready on the process node; wrong
credentials fail with a message naming the object; no credential shows up anywhere."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import READY_TIMEOUT
from tests.support.storage import require_minio
from weightlift.local.demo_stores import DemoStorage, prepare_storage
from weightlift.local.kube import MERGE, call
from weightlift.local.observe import Observer, infer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


@pytest.fixture
def storage(stack: LocalStack, tmp_path: Path) -> Iterator[Callable[..., DemoStorage]]:
    made: list[DemoStorage] = []

    def make(kind: str, name: str, model_dir: Path) -> DemoStorage:
        if kind == "s3":
            require_minio()
        s = prepare_storage(kind, stack.kube, stack.namespace, name, model_dir, tmp_path)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _everything_said(stack: LocalStack, name: str) -> str:
    """Operator log, every worker log of the node, the namespace's Events, the MD's status."""
    parts = [stack.operator_log_tail(100000)]
    worker_logs = [p for p in (stack.state_dir / "node").rglob("worker.log") if name in str(p)]
    assert worker_logs, "no worker log of this deployment to search"
    for log in (stack.state_dir / "node").rglob("*.log"):
        parts.append(log.read_text(errors="replace"))
    parts.append(json.dumps(stack.events()))
    md = stack.get_md(name) or {}
    parts.append(json.dumps(md.get("status", {})))
    for pod in stack.pods(name):
        parts.append(json.dumps(pod.get("status", {})))
    return "\n".join(parts)


def _check_inference(obs: Observer, name: str, probe: JSON) -> None:
    endpoint = obs.summary()["replicas"][0]["endpoint"]
    out = infer(endpoint, name, probe["request"])
    expected = probe["expectedOutputs"][0]
    got = {o["name"]: o for o in out["outputs"]}[expected["name"]]
    worst = max(
        abs(float(a) - float(b)) for a, b in zip(got["data"], expected["data"], strict=True)
    )
    assert worst <= probe["tolerance"]


def test_s3_source_and_p2p_target_reach_ready_without_leaking_the_secret(
    stack: LocalStack,
    deployments: Deploy,
    demo_model: tuple[Path, JSON],
    storage: Callable[..., DemoStorage],
) -> None:
    model_dir, probe = demo_model
    where = storage("s3", "from-s3", model_dir)
    obs = deployments("from-s3", model_dir, probe, replicas=2, model=where.model)
    obs.wait_ready(READY_TIMEOUT)
    rows = obs.replica_statuses()
    froms = sorted(str(r["loadedFrom"]) for r in rows)
    assert froms[1] == "storage:s3", rows
    assert froms[0].startswith("peer:"), rows
    source = next(r for r in rows if r["loadedFrom"] == "storage:s3")
    assert source["bytesLoaded"] == source["bytesTotal"] > 0
    _check_inference(obs, "from-s3", probe)
    said = _everything_said(stack, "from-s3")
    assert "storage:s3" in said  # the grep below looks at the right text
    for secret in where.secret_values:
        assert secret not in said


def test_s3_wrong_credentials_fail_naming_the_bucket_and_leak_nothing(
    stack: LocalStack,
    deployments: Deploy,
    demo_model: tuple[Path, JSON],
    storage: Callable[..., DemoStorage],
) -> None:
    model_dir, probe = demo_model
    where = storage("s3", "bad-s3", model_dir)
    wrong = "wrong-secret-value-31415"
    import base64

    call(
        stack.kube.core.patch_namespaced_secret,
        where.model["credentials"]["name"],
        stack.namespace,
        {"data": {"AWS_SECRET_ACCESS_KEY": base64.b64encode(wrong.encode()).decode()}},
        _content_type=MERGE,
    )
    obs = deployments("bad-s3", model_dir, probe, replicas=1, model=where.model)

    def failed(o: Observer) -> bool:
        return any("s3://models/bad-s3" in str(r.get("message", "")) for r in o.replica_statuses())

    obs.wait(failed, READY_TIMEOUT, "a replica message naming s3://models/bad-s3")
    msg = next(
        str(r["message"]) for r in obs.replica_statuses() if "s3://" in str(r.get("message"))
    )
    assert "secret key in the credentials Secret is wrong" in msg, msg
    said = _everything_said(stack, "bad-s3")
    for secret in [wrong, *where.secret_values]:
        assert secret not in said


def test_pvc_bound_to_a_hostpath_pv_reaches_ready(
    stack: LocalStack,
    deployments: Deploy,
    demo_model: tuple[Path, JSON],
    storage: Callable[..., DemoStorage],
) -> None:
    model_dir, probe = demo_model
    where = storage("pvc", "from-pvc", model_dir)
    assert where.model["uri"] == f"pvc://from-pvc-model/{model_dir.name}"
    obs = deployments("from-pvc", model_dir, probe, replicas=1, model=where.model)
    obs.wait_ready(READY_TIMEOUT)
    (row,) = obs.replica_statuses()
    assert row["loadedFrom"] == "storage:pvc", row
    _check_inference(obs, "from-pvc", probe)
