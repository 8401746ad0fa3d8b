"""Standby on the process node, for real: a Target starts with its source, prepares (hooks,
program, pull buffers) and waits in Standby, never Ready, until the operator hands it peers
through its pod annotation, which the node projects into a file the worker watches. The source
waits at the fault gate before its load until the target is seen in Standby (its front door up,
its probes answered), so the order never depends on timing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from tests.support.e2e import READY_TIMEOUT, held_source
from weightlift.api.labels import PEERS_ANNOTATION
from weightlift.api.worker import PeerCandidate, PeerHandoff
from weightlift.local.demo_plot import plot_demo, timeline_lanes
from weightlift.local.kube import MERGE, call
from weightlift.local.observe import Observer, infer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


def _row(obs: Observer, replica: int) -> JSON:
    return next((r for r in obs.replica_statuses() if r.get("replica") == replica), {})


def _pod_ip(obs: Observer, name: str) -> str:
    pod = next(p for p in obs.pods if p["metadata"]["name"] == name)
    ip: str = pod["status"]["podIP"]
    return ip


def _wait_standby(obs: Observer, replica: int) -> JSON:
    obs.wait(
        lambda o: _row(o, replica).get("phase") == "Standby" and o.status().get("standby") == 1,
        READY_TIMEOUT,
        f"replica {replica} in Standby",
    )
    return _row(obs, replica)


def test_a_target_waits_in_standby_then_pulls_from_its_source(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON], tmp_path: Path
) -> None:
    model_dir, probe = demo_model
    with held_source(stack, "standby") as held:
        obs = deployments("standby", model_dir, probe, replicas=2)
        source = held.pod()
        target = _wait_standby(obs, 1)
        assert target["role"] == "Target" and target["hooksRun"] is True
        assert not target["ready"] and not _row(obs, 0).get("ready")
        # Both pods exist at once; the target is not Ready and its model routes are closed.
        assert len(obs.pods) == 2
        pod = next(p for p in obs.pods if p["metadata"]["name"] == target["name"])
        assert pod["metadata"]["annotations"].get(PEERS_ANNOTATION) == ""
        ready = [c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "False"
        url = f"http://{_pod_ip(obs, target['name'])}:8000"
        refused = httpx.post(f"{url}/v2/models/standby/infer", json=probe["request"], timeout=10)
        assert refused.status_code == 503 and "Standby" in refused.text
    obs.wait_ready(READY_TIMEOUT)
    target = _row(obs, 1)
    assert target["loadedFrom"] == f"peer:{source}" and target["role"] == "Target"
    summary = obs.summary()
    moments = {r["name"]: r for r in summary["replicas"]}[target["name"]]
    assert moments["createdAt"] <= moments["standbyAt"] <= moments["readyAt"]
    assert summary["sourceReadyAt"] <= summary["readyAt"]
    # `demo --plot` of this run: a lane a replica, the target's standby and load in its lane.
    lanes = {lane.name.split("\n")[0]: dict(lane.steps) for lane in timeline_lanes(summary)}
    assert set(lanes) == {source, target["name"]}
    assert {"standby", "load", "probe"} <= set(lanes[target["name"]])
    assert "standby" not in lanes[source]
    with Image.open(plot_demo(summary, tmp_path / "standby.png")) as im:
        assert im.format == "PNG"
    out = infer(url, "standby", probe["request"])["outputs"]
    src = infer(f"http://{_pod_ip(obs, source)}:8000", "standby", probe["request"])["outputs"]
    assert out == src


def test_wait_for_source_expiry_hands_the_target_storage(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    with held_source(stack, "expiry") as held:
        obs = deployments("expiry", model_dir, probe, replicas=2, wait_for_source_seconds=3)
        held.pod()
        obs.wait(
            lambda o: bool(_row(o, 1).get("ready")),
            READY_TIMEOUT,
            "the target Ready from storage while its source is held",
        )
        target = _row(obs, 1)
        assert target["loadedFrom"] == "storage:hostpath" and target["role"] == "Source"
        events = stack.events("expiry")
        assert "WaitForSourceExpired" in {e["reason"] for e in events}
    obs.wait_ready(READY_TIMEOUT)


def test_a_peer_of_another_identity_is_refused(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """Someone hands a waiting target a Ready pod of another model identity (another revision):
    it refuses (peer token and identity differ) and loads its own weights from storage. The
    operator is down meanwhile, so that only the forged hand-off reaches the target."""
    model_dir, probe = demo_model
    foreign = deployments("foreign", model_dir, probe, replicas=1, revision="2")
    foreign.wait_ready(READY_TIMEOUT)
    foreign_pod = foreign.replica_statuses()[0]["name"]
    address = f"{_pod_ip(foreign, foreign_pod)}:8000"
    with held_source(stack, "victim") as held:
        obs = deployments("victim", model_dir, probe, replicas=2)
        held.pod()
        target = _wait_standby(obs, 1)
        status_url = f"http://{_pod_ip(obs, target['name'])}:8000/weightlift/v1/status"
        stack.kill_operator()
        try:
            handoff = PeerHandoff(peers=[PeerCandidate(pod=foreign_pod, address=address)])
            call(
                stack.kube.core.patch_namespaced_pod,
                target["name"],
                stack.namespace,
                {"metadata": {"annotations": {PEERS_ANNOTATION: handoff.to_text()}}},
                _content_type=MERGE,
            )
            deadline = time.monotonic() + READY_TIMEOUT
            report: JSON = {}
            while report.get("phase") not in ("Serving", "Failed"):
                assert time.monotonic() < deadline, f"target never served: {report}"
                time.sleep(0.25)
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    report = httpx.get(status_url, timeout=5).json()
        finally:
            stack.restart_operator()
        assert report["phase"] == "Serving" and report["loadedFrom"] == "storage:hostpath"
    # It did try the foreign peer, and the peer refused it.
    logs = stack.node.pod_logs(stack.namespace, target["name"])
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    assert f"peer {foreign_pod}" in text and "falling back to storage" in text, text[-3000:]
    obs.wait_ready(READY_TIMEOUT)
