"""The real LeaderWorkerSet controller (sigs.k8s.io/lws, `make lws`) in the local stack, on its
own (no operator involved yet): an LWS of size 2 gets its leader StatefulSet, the worker
StatefulSet its leader's pod creation triggers, and both pods run on the process node with the
env LWS's pod webhook injects (issue 35, the piece multi-pod replicas will run on)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from weightlift.local.kube import call, get_or_none
from weightlift.local.lws import (
    GROUP_INDEX_LABEL,
    LWS_GROUP,
    SET_NAME_LABEL,
    WORKER_INDEX_LABEL,
    LwsController,
)
from weightlift.local.processnode import LOCAL_NODE_LABEL
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]

# Writes the LWS env it was started with where the test reads it, then waits to be stopped.
RANK = (
    "import os, pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "keys = ('LWS_LEADER_ADDRESS', 'LWS_GROUP_SIZE', 'LWS_WORKER_INDEX')\n"
    "out = pathlib.Path(os.environ['OUT_DIR']) / os.environ['POD_NAME']\n"
    "out.write_text('\\n'.join(f'{k}={os.environ.get(k, \"\")}' for k in keys))\n"
    "while True: time.sleep(1)\n"
)


def _lws(name: str, size: int, out_dir: Path) -> JSON:
    pod_spec = {
        "terminationGracePeriodSeconds": 2,
        "nodeSelector": {LOCAL_NODE_LABEL: "true"},
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "rank",
                "image": "local/none",
                "command": [sys.executable, "-c", RANK],
                "env": [
                    {"name": "OUT_DIR", "value": str(out_dir)},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                ],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }
        ],
    }
    return {
        "apiVersion": f"{LWS_GROUP}/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"spec": pod_spec},
            },
        },
    }


def _until(what: str, fn: Callable[[], Any], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"{what} not within {timeout:.0f}s; last: {last!r}")


def test_lws_of_size_two_runs_leader_and_worker_on_the_process_node(
    stack: LocalStack, lws: LwsController, tmp_path: Path
) -> None:
    ns, name = stack.namespace, "grp"
    custom, apps = stack.kube.custom, client.AppsV1Api(stack.kube.api)
    call(
        custom.create_namespaced_custom_object,
        LWS_GROUP,
        "v1",
        ns,
        "leaderworkersets",
        _lws(name, 2, tmp_path),
    )
    try:
        # The LWS webhook defaulted the object (startupPolicy is not in what we sent).
        got = call(
            custom.get_namespaced_custom_object, LWS_GROUP, "v1", ns, "leaderworkersets", name
        )
        assert got["spec"]["startupPolicy"] == "LeaderCreated"
        # The leader StatefulSet (one leader per group) and, once the leader pod exists, the
        # group's worker StatefulSet (size - 1 workers), both owned by LWS.
        leader_sts = _until(
            "leader StatefulSet", lambda: get_or_none(apps.read_namespaced_stateful_set, name, ns)
        )
        worker_sts = _until(
            "worker StatefulSet",
            lambda: get_or_none(apps.read_namespaced_stateful_set, f"{name}-0", ns),
        )
        assert leader_sts["spec"]["replicas"] == 1 and worker_sts["spec"]["replicas"] == 1
        assert leader_sts["metadata"]["ownerReferences"][0]["kind"] == "LeaderWorkerSet"
        assert worker_sts["metadata"]["ownerReferences"][0]["name"] == f"{name}-0"  # the leader pod

        def running() -> list[JSON] | None:
            pods = [
                get_or_none(stack.kube.core.read_namespaced_pod, p, ns)
                for p in (f"{name}-0", f"{name}-0-1")
            ]
            ok = all(p and p.get("status", {}).get("phase") == "Running" for p in pods)
            return [p for p in pods if p] if ok else None

        leader, worker = _until("leader and worker pods Running", running)
        for pod in (leader, worker):
            assert pod["spec"]["nodeName"] == stack.node_name
            assert pod["metadata"]["labels"][SET_NAME_LABEL] == name
        # The pod webhook's work: indexes as labels, the group's env in every container.
        assert leader["metadata"]["labels"][WORKER_INDEX_LABEL] == "0"
        assert leader["metadata"]["labels"][GROUP_INDEX_LABEL] == "0"
        assert worker["metadata"]["labels"][WORKER_INDEX_LABEL] == "1"
        leader_address = f"{name}-0.{name}.{ns}"
        for pod, index in ((leader, "0"), (worker, "1")):
            seen = _until(
                f"{pod['metadata']['name']} to write its env",
                lambda p=pod: (
                    (tmp_path / p["metadata"]["name"]).is_file()
                    and (tmp_path / p["metadata"]["name"]).read_text()
                ),
            )
            env = dict(line.split("=", 1) for line in seen.splitlines())
            assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == index
            assert env["LWS_LEADER_ADDRESS"].startswith(leader_address), env
        # The group counts as a Ready replica of the LWS once both pods are Ready.
        _until(
            "LWS status readyReplicas 1",
            lambda: (
                call(
                    custom.get_namespaced_custom_object,
                    LWS_GROUP,
                    "v1",
                    ns,
                    "leaderworkersets",
                    name,
                )
                .get("status", {})
                .get("readyReplicas")
                == 1
            ),
        )
    finally:
        try:
            call(
                custom.delete_namespaced_custom_object,
                LWS_GROUP,
                "v1",
                ns,
                "leaderworkersets",
                name,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    # Garbage collection takes the StatefulSets and pods along.
    _until(
        "the group's pods gone",
        lambda: all(
            get_or_none(stack.kube.core.read_namespaced_pod, p, ns) is None
            for p in (f"{name}-0", f"{name}-0-1")
        ),
        timeout=120,
    )
