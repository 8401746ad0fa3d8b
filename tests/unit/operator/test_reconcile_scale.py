"""What keeps the operator's API traffic and memory flat at scale (measured by `weightlift bench
operator`): passes wait for pods they created to reach the index, probe times alone do not
rewrite a status every period, one LIST of nodes serves every pass that needs it, the pod index
keeps only what a pass reads, a serving worker's report is read with its probe, and the
operator's own labels do not make kopf rewrite its diff base."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, cast

import pytest
from aiohttp import web

from tests.support.planning import no_sources
from weightlift.api.labels import INFERENCE_PROBE_GATE, REPLICA_LABEL, ROLE_LABEL
from weightlift.api.model import ProbeResult
from weightlift.operator import kube, reconcile
from weightlift.operator import state as operator_state
from weightlift.operator.planning import SpecError
from weightlift.operator.probes import WorkerClient
from weightlift.operator.state import OperatorState

UID = "3c1f7c3e-0000-4000-8000-000000000001"


def _state() -> OperatorState:
    # No clients: a test that reaches the API server fails on None.
    return OperatorState(core=cast(Any, None), custom=cast(Any, None), http=cast(Any, None))


def _body() -> dict[str, Any]:
    meta = {"name": "llama", "namespace": "ns", "uid": UID, "generation": 1}
    return {"metadata": meta, "spec": {"model": {"uri": "hostpath:///m"}, "replicas": 2}}


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": {}}, "status": {}}


async def test_a_pass_waits_for_pods_it_created_to_reach_the_index() -> None:
    state = _state()
    state.await_pod(UID, "llama-abc-0")
    log = logging.getLogger("test")
    # Not in the index yet: the pass returns before observing or writing anything.
    assert await reconcile.reconcile(state, _body(), [], no_sources, log) == 1.0
    assert state.awaited_pods(UID, set()) == ["llama-abc-0"]
    # Indexed: nothing is awaited any more.
    assert state.awaited_pods(UID, {"llama-abc-0"}) == []
    assert not state.deployment(UID).awaited


def test_a_pod_that_never_shows_up_is_given_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    monkeypatch.setattr(operator_state, "CREATED_POD_WAIT_SECONDS", 0.0)
    state.await_pod(UID, "llama-abc-0")
    time.sleep(0.01)
    assert state.awaited_pods(UID, set()) == []


def _status(probe_time: str, latency: float, phase: str = "Ready") -> dict[str, Any]:
    probe = {"passed": True, "message": "ok", "lastProbeTime": probe_time, "latencyMs": latency}
    return {"phase": phase, "replicaStatuses": [{"name": "p-0", "probe": probe}, {"name": "p-1"}]}


def test_probe_times_alone_wait_for_the_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    before = _status("2026-01-01T00:00:00Z", 3.0)
    later = _status("2026-01-01T00:00:10Z", 4.5)
    # Never written by this operator: write.
    assert not reconcile._only_probe_times_moved(state, UID, later, before)
    state.deployment(UID).written_at = time.monotonic()
    assert reconcile._only_probe_times_moved(state, UID, later, before)
    # Anything else that moved is written at once.
    moved = _status("2026-01-01T00:00:10Z", 4.5, phase="Degraded")
    assert not reconcile._only_probe_times_moved(state, UID, moved, before)
    failing = _status("2026-01-01T00:00:10Z", 4.5)
    failing["replicaStatuses"][0]["probe"]["passed"] = False
    assert not reconcile._only_probe_times_moved(state, UID, failing, before)
    # After the refresh period the probe times are written too.
    monkeypatch.setattr(reconcile, "PROBE_TIME_REFRESH_SECONDS", 0.0)
    assert not reconcile._only_probe_times_moved(state, UID, later, before)


async def test_one_node_list_serves_every_waiting_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    release = threading.Event()

    def list_nodes(core: Any, resource: str) -> int:
        calls.append(resource)
        release.wait(5)
        return 8

    monkeypatch.setattr(kube, "max_node_gpus", list_nodes)
    state = _state()
    waiting = [asyncio.ensure_future(state.max_node_gpus()) for _ in range(20)]
    await asyncio.sleep(0.1)
    release.set()
    assert await asyncio.gather(*waiting) == [8] * 20
    assert calls == ["nvidia.com/gpu"]
    assert await state.max_node_gpus() == 8 and len(calls) == 1  # cached now


async def test_a_finished_node_list_is_cached_before_its_waiters_wake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass that asks between the LIST's end and its waiters' wake-up gets the cached answer
    (here the only waiter is gone): no second LIST."""
    calls: list[str] = []

    def list_nodes(core: Any, resource: str) -> int:
        calls.append(resource)
        return 8

    monkeypatch.setattr(kube, "max_node_gpus", list_nodes)
    state = _state()
    waiter = asyncio.ensure_future(state.max_node_gpus())
    await asyncio.sleep(0)  # the fetch starts
    waiter.cancel()
    fetch = state._node_fetches.get("nvidia.com/gpu")
    assert fetch is not None
    assert await fetch == 8
    assert await state.max_node_gpus() == 8
    assert calls == ["nvidia.com/gpu"]


def _full_pod() -> dict[str, Any]:
    """A pod as the API server sends it after kwok ran it (the parts that weigh)."""
    stamp = "2026-01-01T00:00:00Z"
    conditions = [
        {"type": kind, "status": "True", "lastProbeTime": None, "lastTransitionTime": stamp}
        for kind in ("Initialized", "ContainersReady", "PodReadyToStartContainers", "Ready")
    ]
    conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp})
    return {
        "metadata": {
            "name": "llama-abc-0",
            "namespace": "ns",
            "uid": "uid-0",
            "resourceVersion": "42",
            "labels": {REPLICA_LABEL: "0", ROLE_LABEL: "Source", "app": "x"},
            "annotations": {"weightlift.dev/plan": "{...}" * 100},
            "ownerReferences": [{"kind": "ModelDeployment", "uid": UID}],
            "managedFields": [{"manager": "kwok", "fieldsV1": {"f:status": {}}}] * 5,
        },
        "spec": {"nodeName": "gpu-0", "containers": [{"name": "worker", "env": []}] * 3},
        "status": {
            "phase": "Running",
            "podIP": "127.244.0.7",
            "conditions": conditions,
            "containerStatuses": [{"name": "worker", "state": {"running": {"startedAt": stamp}}}],
        },
    }


def test_the_pod_index_keeps_only_what_a_pass_reads() -> None:
    pod = _full_pod()
    slim = reconcile.pod_essentials(pod)
    assert slim["metadata"] == {
        "name": "llama-abc-0",
        "uid": "uid-0",
        "labels": {REPLICA_LABEL: "0", ROLE_LABEL: "Source"},
    }
    assert slim["spec"] == {"nodeName": "gpu-0"}
    # The hand-off annotation is kept: planning reads what a Target was handed.
    pod["metadata"]["annotations"]["weightlift.dev/peers"] = '{"storage":true}'
    kept = reconcile.pod_essentials(pod)["metadata"]["annotations"]
    assert kept == {"weightlift.dev/peers": '{"storage":true}'}
    assert slim["status"]["conditions"] == [
        {"type": "ContainersReady", "status": "True"},
        {"type": "Ready", "status": "True"},
        {"type": "PodScheduled", "status": "True"},
    ]
    assert slim["status"]["containerStatuses"] == []
    assert len(json.dumps(slim)) * 5 < len(json.dumps(pod))
    # What a pass concludes from the slim copy is what it concludes from the whole pod.
    assert reconcile._pod_ready(slim) and reconcile._pod_ready(pod)
    assert reconcile._probe_gate(slim) is reconcile._probe_gate(pod) is None  # an older pod
    # The inference-probe readiness gate and its condition are kept too.
    pod["spec"]["readinessGates"] = [{"conditionType": INFERENCE_PROBE_GATE}]
    gate = {"type": INFERENCE_PROBE_GATE, "status": "True", "lastTransitionTime": "2026"}
    pod["status"]["conditions"].append(gate)
    gated = reconcile.pod_essentials(pod)
    assert gated["spec"]["readinessGates"] == [{"conditionType": INFERENCE_PROBE_GATE}]
    assert reconcile._probe_gate(gated) is reconcile._probe_gate(pod) is True
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    pod["status"]["conditions"] = [{**unschedulable, "message": "0/4 nodes", "lastProbeTime": 1}]
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    slim = reconcile.pod_essentials(pod)
    assert reconcile._unschedulable(slim) == "0/4 nodes"
    assert slim["metadata"]["deletionTimestamp"] == "2026-01-01T00:01:00Z"


def test_a_terminated_container_keeps_its_message() -> None:
    pod = _full_pod()
    terminated = {"exitCode": 3, "reason": "Error", "message": "boom", "containerID": "x" * 80}
    pod["status"]["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    slim = reconcile.pod_essentials(pod)
    assert reconcile._termination(slim) == reconcile._termination(pod)
    assert reconcile._termination(slim)[0] == "worker exited with code 3: boom"


def test_an_evicted_pod_says_the_kubelet_evicted_it_and_why() -> None:
    """Evicted for disk, the worker is SIGKILLed (137): the status says the node's reason."""
    pod = _full_pod()
    terminated = {"exitCode": 137, "reason": "Error", "containerID": "x" * 80}
    pod["status"]["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    why = "The node was low on resource: ephemeral-storage. Threshold quantity: 2Gi."
    pod["status"].update({"phase": "Failed", "reason": "Evicted", "message": why})
    slim = reconcile.pod_essentials(pod)
    assert reconcile._termination(slim) == reconcile._termination(pod)
    assert reconcile._termination(slim)[0] == f"evicted by the kubelet: {why}"
    del pod["status"]["reason"]
    assert reconcile._termination(pod)[0] == "worker exited with code 137: Error"


def test_a_container_restarted_in_place_keeps_its_count_and_last_message() -> None:
    """A group's pod (restartPolicy Always) running again after a failure: the slim copy keeps
    how often it restarted and why its last run ended (groups.collapse fails its group)."""
    pod = _full_pod()
    last = {"exitCode": 1, "reason": "Error", "message": "no such file", "startedAt": "x"}
    pod["status"]["containerStatuses"] = [
        {
            "name": "worker",
            "restartCount": 2,
            "state": {"running": {}},
            "lastState": {"terminated": last},
        }
    ]
    slim = reconcile.pod_essentials(pod)
    assert slim["status"]["containerStatuses"] == [
        {
            "restartCount": 2,
            "lastState": {
                "terminated": {"message": "no such file", "reason": "Error", "exitCode": 1}
            },
        }
    ]
    assert reconcile._termination(slim) == (None, None)  # running now
    assert reconcile._termination(slim, "lastState")[0] == "worker exited with code 1: no such file"


def test_a_container_that_cannot_start_is_named_with_its_image() -> None:
    """The kubelet's waiting reason survives the slim copy; progress (ContainerCreating) is
    no problem to report."""
    pod = _full_pod()
    image = "ghcr.io/weightlift/worker:nope"
    waiting = {
        "reason": "ImagePullBackOff",
        "message": f'Back-off pulling image "{image}": ErrImagePull: not found',
    }
    pod["status"]["containerStatuses"] = [
        {"name": "worker", "image": image, "state": {"waiting": waiting}, "imageID": ""}
    ]
    slim = reconcile.pod_essentials(pod)
    assert reconcile._stuck(slim) == reconcile._stuck(pod)
    assert reconcile._stuck(slim) == (
        f'image {image}: ImagePullBackOff (Back-off pulling image "{image}": ErrImagePull: '
        "not found)"
    )
    pod["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    assert reconcile._stuck(pod) is None
    assert reconcile.pod_essentials(pod)["status"]["containerStatuses"] == []


SERVING = {"phase": "Serving", "bytesLoaded": 1, "bytesTotal": 1}


async def test_a_serving_workers_report_is_reread_only_when_stale_or_in_doubt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[str] = []

    async def status(request: web.Request) -> web.Response:
        reads.append(request.path)
        return web.json_response(SERVING)

    app = web.Application()
    app.router.add_get("/weightlift/v1/status", status)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    address = f"{host}:{port}"
    state = _state()
    state.http = WorkerClient()
    spec = reconcile.parse_spec(_body()["spec"])
    assert not isinstance(spec, SpecError)
    # Loading (pod not Ready): read on every pass.
    for _ in range(2):
        report = await reconcile._report(state, "uid-0", address, spec, pod_ready=False)
    assert report is not None and len(reads) == 2
    # Serving, probes passing: the report is reused, probe period after probe period.
    await reconcile._report(state, "uid-0", address, spec, pod_ready=True)
    state.pod("uid-0").probe = (time.monotonic(), ProbeResult(passed=True, message="ok"))
    for _ in range(3):
        report = await reconcile._report(state, "uid-0", address, spec, pod_ready=True)
    state.pod("uid-0").probe = (time.monotonic() - 3600, ProbeResult(passed=True, message="ok"))
    report = await reconcile._report(state, "uid-0", address, spec, pod_ready=True)
    assert report is not None and report.phase == "Serving" and len(reads) == 3
    # Read again once it is REPORT_REFRESH_SECONDS old...
    cached = state.pod("uid-0").report
    assert cached is not None
    read_at, last = cached
    state.pod("uid-0").report = (read_at - reconcile.REPORT_REFRESH_SECONDS, last)
    await reconcile._report(state, "uid-0", address, spec, pod_ready=True)
    assert len(reads) == 4
    # ...at once after a failed probe, and when the pod is no longer Ready.
    state.pod("uid-0").probe = (time.monotonic(), ProbeResult(passed=False, message="wrong output"))
    await reconcile._report(state, "uid-0", address, spec, pod_ready=True)
    assert len(reads) == 5
    state.pod("uid-0").probe = (time.monotonic(), ProbeResult(passed=True, message="ok"))
    await reconcile._report(state, "uid-0", address, spec, pod_ready=False)
    assert len(reads) == 6 and state.pod("uid-0").report is None
    assert set(reads) == {"/weightlift/v1/status"}
    await state.http.aclose()
    await runner.cleanup()


class _Response:
    """What urllib3 returns for `_preload_content=False`: the body still unread."""

    def __init__(self) -> None:
        self.drained = self.released = False
        self.data = b"{}"

    def drain_conn(self) -> None:
        self.drained = True

    def release_conn(self) -> None:
        self.released = True


class _Api:
    """Any kubernetes client method: records the response it handed out."""

    def __init__(self) -> None:
        self.responses: list[_Response] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> _Response:
            assert kwargs.get("_preload_content") is False, f"{name} decodes a body nobody reads"
            self.responses.append(_Response())
            return self.responses[-1]

        return call


def test_every_write_gives_its_connection_back() -> None:
    """An unread response keeps its connection out of the pool: the next call opened a new
    one (a TLS handshake on both sides)."""
    api = _Api()
    md = {"metadata": {"name": "llama", "namespace": "ns", "uid": UID}}
    writes = [
        lambda: kube.create_pod(cast(Any, api), "ns", {"metadata": {"name": "p"}}),
        lambda: kube.delete_pod(cast(Any, api), "ns", "p"),
        lambda: kube.patch_pod_metadata(cast(Any, api), "ns", "p", {"labels": {"a": "b"}}),
        lambda: kube.patch_status(cast(Any, api), "ns", "llama", {"phase": "Ready"}),
        lambda: kube.post_event(cast(Any, api), md, "Normal", "PhaseReady", "ready"),
    ]
    for write in writes:
        write()
    assert len(api.responses) == len(writes)
    assert all(r.drained and r.released for r in api.responses)


async def test_each_gpu_resource_name_is_listed_and_cached_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offered = {"nvidia.com/gpu": 8, "nvidia.com/mig-1g.10gb": 7}
    calls: list[str] = []

    def list_nodes(core: Any, resource: str) -> int:
        calls.append(resource)
        return offered[resource]

    monkeypatch.setattr(kube, "max_node_gpus", list_nodes)
    state = _state()
    assert await state.max_node_gpus("nvidia.com/mig-1g.10gb") == 7
    assert await state.max_node_gpus() == 8
    assert await state.max_node_gpus("nvidia.com/mig-1g.10gb") == 7  # cached
    assert calls == ["nvidia.com/mig-1g.10gb", "nvidia.com/gpu"]
