"""Multi-pod replicas through the real LeaderWorkerSet controller (issue 35): a ModelDeployment of
2 replicas x 2 pods (tensor 2, one rank per pod) on the process node, builtin runtime. The
operator renders one LeaderWorkerSet; LWS creates the groups; the first group loads from
storage, the second pulls rank-matched from it; each group computes its answer across both of
its pods (torch.distributed, gloo); the ModelDeployment's Service selects each serving group's
leader only, Ready through its inference-probe gate; a killed rank fails its group, which is
replaced (and its new leader takes the old one's place in the Service)."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import watch

from tests.support.endpoints import pod_ready
from weightlift.api.labels import (
    INFERENCE_PROBE_GATE,
    LWS_API_VERSION,
    LWS_GROUP,
    LWS_PLURAL,
    SERVING_LABEL,
)
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.local.kube import call
from weightlift.local.lws import LwsController
from weightlift.local.observe import Observer, infer
from weightlift.local.stack import LocalStack, make_demo_model

JSON = dict[str, Any]
NAME = "grp"
READY_TIMEOUT = 300.0

pytestmark = pytest.mark.timeout(900)


def shard_bytes(path: Path) -> int:
    """Tensor bytes of one safetensors file, from its header (what a rank must load)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(
        end - begin
        for k, v in header.items()
        if k != "__metadata__"
        for begin, end in [v["data_offsets"]]
    )


def _until(what: str, fn: Callable[[], Any], timeout: float, stack: LocalStack) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        stack.check_operator()
        last = fn()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(
        f"{what} not within {timeout:.0f}s; last: {last!r}\n{stack.operator_log_tail()}"
    )


def _status_event(
    what: str, since: str, fn: Callable[[JSON], bool], timeout: float, stack: LocalStack
) -> JSON:
    """The first version of the ModelDeployment written after resourceVersion `since` for
    which `fn` holds, from a watch: no version written in between is skipped."""
    deadline = time.monotonic() + timeout
    version, seen = since, 0
    while time.monotonic() < deadline:
        stack.check_operator()
        stream = watch.Watch().stream(
            stack.kube.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            stack.namespace,
            PLURAL,
            field_selector=f"metadata.name={NAME}",
            resource_version=version,
            timeout_seconds=max(1, min(10, int(deadline - time.monotonic()))),
        )
        for event in stream:
            md = event["object"]
            assert event["type"] != "ERROR", f"the watch since {since} broke: {md}"
            version, seen = md["metadata"]["resourceVersion"], seen + 1
            if fn(md):
                return dict(md)
    raise AssertionError(
        f"{what}: not in any of the {seen} versions written within {timeout:.0f}s\n"
        f"{stack.operator_log_tail()}"
    )


def _groups(obs: Observer) -> dict[str, JSON]:
    obs.poll()  # the Observer holds the last ModelDeployment it read
    return {r["name"]: r for r in obs.replica_statuses()}


def _ready(obs: Observer) -> dict[str, JSON] | None:
    groups = _groups(obs)
    status = obs.status()
    if (
        status.get("readyReplicas") == 2
        and len(groups) == 2
        and all(g["ready"] for g in groups.values())
    ):
        return groups
    return None


def _check_the_service_holds_the_leaders(stack: LocalStack, groups: dict[str, JSON]) -> None:
    """The Service's selector takes in each group's leader and no other pod; the leaders wait
    for the inference-probe gate and are Ready (it turned True), the others carry no gate."""
    ns = stack.namespace
    selector = call(stack.kube.core.read_namespaced_service, NAME, ns)["spec"]["selector"]
    assert selector[SERVING_LABEL] == "true", selector
    chosen = ",".join(f"{k}={v}" for k, v in selector.items())
    selected = call(stack.kube.core.list_namespaced_pod, ns, label_selector=chosen)["items"]
    leaders = sorted(g["pods"][0]["name"] for g in groups.values())
    assert sorted(p["metadata"]["name"] for p in selected) == leaders
    gate = [{"conditionType": INFERENCE_PROBE_GATE}]
    for group in groups.values():
        leader, follower = (
            call(stack.kube.core.read_namespaced_pod, p["name"], ns) for p in group["pods"]
        )
        assert leader["spec"]["readinessGates"] == gate
        assert not follower["spec"].get("readinessGates"), follower["spec"]
        assert SERVING_LABEL not in follower["metadata"]["labels"]
        shown = pod_ready(stack.kube, ns, leader["metadata"]["name"], True, 60)
        assert {c["type"]: c["status"] for c in shown["status"]["conditions"]}[
            INFERENCE_PROBE_GATE
        ] == "True"


def test_two_groups_of_two_pods_load_rank_matched_and_compute_across_their_pods(
    stack: LocalStack,
    lws: LwsController,
    deployments: Callable[..., Observer],
    e2e_dir: Path,
) -> None:
    model_dir = e2e_dir / "tp2-model"
    probe = make_demo_model(model_dir, 4.0, tp=2, hook=True, seed=3)
    obs = deployments(
        NAME,
        model_dir,
        probe,
        replicas=2,
        parallelism={"tensor": 2, "podsPerReplica": 2},
    )
    groups = _until("both groups Ready", lambda: _ready(obs), READY_TIMEOUT, stack)

    by_role = {g["role"]: g for g in groups.values()}
    assert set(by_role) == {"Source", "Target"}, groups
    source, target = by_role["Source"], by_role["Target"]
    for group in (source, target):
        pods = group["pods"]
        assert [p["index"] for p in pods] == [0, 1]
        # One LeaderWorkerSet per group, named as the replica: LWS's leader is `<set>-0`.
        assert [p["name"] for p in pods] == [f"{group['name']}-0", f"{group['name']}-0-1"]
        for index, pod in enumerate(pods):
            # Each pod holds its own rank, and loaded exactly that rank's shard.
            assert pod["ranks"] == [index]
            own = shard_bytes(model_dir / f"rank-{index}-of-2.safetensors")
            assert pod["bytesLoaded"] == pod["bytesTotal"] == own, pod
    # The source group read storage; the target's pod i pulled from the source's pod i.
    assert [p["loadedFrom"] for p in source["pods"]] == ["storage:hostpath"] * 2
    assert [p["loadedFrom"] for p in target["pods"]] == [
        f"peer:{p['name']}" for p in source["pods"]
    ]

    # Both leaders answer the probe with the same output, computed across their group: a
    # follower serves no inference of its own.
    model = NAME
    answers = []
    for group in (source, target):
        leader, follower = group["pods"]
        out = infer(f"http://{leader['podIP']}:8000", model, probe["request"])
        answers.append(out["outputs"][0]["data"])
        refused = httpx.post(
            f"http://{follower['podIP']}:8000/v2/models/{model}/infer",
            json=probe["request"],
            timeout=10,
        )
        assert 400 <= refused.status_code < 500, refused.text
    assert answers[0] == answers[1]
    _check_the_service_holds_the_leaders(stack, groups)
    expected = probe["expectedOutputs"][0]["data"]
    assert max(abs(a - b) for a, b in zip(answers[0], expected, strict=True)) < 1e-3

    # Kill rank 1 of the target group: its leader can no longer compute, the group stops being
    # Ready, and LWS + the operator replace it; both groups end up Ready again.
    victim = target["pods"][1]["name"]
    # One pod, named exactly (tests.support.e2e.pids_of matches "<name>-..." prefixes).
    pids = [
        pid for key, ps in stack.node.pids().items() if key == f"default/{victim}" for pid in ps
    ]
    assert pids, f"no process for {victim}"
    old_uids = {
        p["metadata"]["uid"]
        for p in stack.pods(NAME)
        if p["metadata"]["name"].startswith(target["name"])
    }
    since = (stack.get_md(NAME) or {})["metadata"]["resourceVersion"]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    def target_not_ready(md: JSON) -> bool:
        rows = {r["name"]: r for r in (md.get("status") or {}).get("replicaStatuses") or []}
        group = rows.get(target["name"])
        return group is None or not group["ready"]

    # Every status the operator writes after the kill, from a watch (the group may be replaced
    # and Ready again between two reads): one of them says the target group is not Ready.
    _status_event("the target group's probe to fail", since, target_not_ready, 90, stack)
    groups = _until("both groups Ready again", lambda: _ready(obs), READY_TIMEOUT, stack)
    new_uids = {
        p["metadata"]["uid"]
        for p in stack.pods(NAME)
        if p["metadata"]["name"].startswith(target["name"])
    }
    assert not (new_uids & old_uids), "the group's pods were not replaced"
    leaders = [g["pods"][0]["podIP"] for g in groups.values()]
    outs = [
        infer(f"http://{ip}:8000", model, probe["request"])["outputs"][0]["data"] for ip in leaders
    ]
    assert outs[0] == outs[1] == answers[0]
    _check_the_service_holds_the_leaders(stack, groups)  # the new target group's leader

    # Scaled to 1: planning keeps the Source (Targets go first) and the operator deletes the
    # Target's own LeaderWorkerSet; one set is left, the Source's.
    sources = [g["name"] for g in groups.values() if g["role"] == "Source"]
    stack.kube.custom.patch_namespaced_custom_object(
        GROUP, VERSION, stack.namespace, PLURAL, NAME, {"spec": {"replicas": 1}}
    )

    def one_group_left() -> list[str] | None:
        listed = call(
            stack.kube.custom.list_namespaced_custom_object,
            LWS_GROUP,
            LWS_API_VERSION,
            stack.namespace,
            LWS_PLURAL,
        )
        sets: list[JSON] = listed["items"]
        names = sorted(s["metadata"]["name"] for s in sets)
        rows = _groups(obs)
        return names if len(names) == 1 and list(rows) == names else None

    assert _until("one group left", one_group_left, READY_TIMEOUT, stack) == sources
