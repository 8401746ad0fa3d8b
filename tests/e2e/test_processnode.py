"""The process node on its own: plain pods (no operator involved) scheduled by the real scheduler,
run as processes, probed, reported, and cleaned up on deletion."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kubernetes import client, watch

from tests.support.e2e import alive
from weightlift.local.kube import call, delete, get_or_none
from weightlift.local.processnode import LOCAL_NODE_LABEL
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]

SERVER = (
    "import http.server, os, signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(0)))\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = (os.environ['POD_NAME'] + ' ' + os.environ['MY_IP']).encode()\n"
    "        ready = os.path.exists(os.environ['READY_FILE'])\n"
    "        print('answered', 200 if ready else 503, flush=True)\n"
    "        self.send_response(200 if ready else 503)\n"
    "        self.end_headers(); self.wfile.write(body)\n"
    "http.server.HTTPServer((os.environ['POD_IP'], 8080), H).serve_forever()\n"
)


def _pod(name: str, command: list[str], **container: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": "processnode"}},
        "spec": {
            "restartPolicy": container.pop("restartPolicy", "Never"),
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {LOCAL_NODE_LABEL: "true"},
            "automountServiceAccountToken": False,  # like worker pods: no API token
            "containers": [
                {
                    "name": "main",
                    "image": "local/none",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    **container,
                }
            ],
        },
    }


def _get_pod(stack: LocalStack, name: str) -> JSON | None:
    return get_or_none(stack.kube.core.read_namespaced_pod, name, stack.namespace)


def _wait(stack: LocalStack, name: str, pred: Callable[[JSON], bool], timeout: float = 60) -> JSON:
    deadline = time.monotonic() + timeout
    pod: JSON | None = None
    while time.monotonic() < deadline:
        pod = _get_pod(stack, name)
        if pod is not None and pred(pod):
            return pod
        time.sleep(0.2)
    raise AssertionError(f"pod {name} never matched; last: {(pod or {}).get('status')}")


def _log(stack: LocalStack, name: str) -> str:
    logs = (stack.state_dir / "node" / "pods").glob(f"{stack.namespace}_{name}_*/main.log")
    return "".join(p.read_text(errors="replace") for p in logs)


def _wait_log(
    stack: LocalStack, name: str, pred: Callable[[str], bool], timeout: float = 60
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = _log(stack, name)
        if pred(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"pod {name}'s log never matched; last: {_log(stack, name)[-500:]!r}")


def _versions(stack: LocalStack, name: str, since: str) -> list[JSON]:
    """The pod as it is now and every version of it written after resourceVersion `since`,
    from a watch (none written in between is skipped)."""
    now = call(stack.kube.core.read_namespaced_pod, name, stack.namespace)
    found: list[JSON] = []
    if now["metadata"]["resourceVersion"] != since:
        plain = client.ApiClient()  # the watch's model objects back to wire JSON
        stream = watch.Watch().stream(
            stack.kube.core.list_namespaced_pod,
            stack.namespace,
            field_selector=f"metadata.name={name}",
            resource_version=since,
            timeout_seconds=30,
        )
        for event in stream:
            assert event["type"] != "ERROR", f"the watch of {name} since {since} broke: {event}"
            found.append(plain.sanitize_for_serialization(event["object"]))
            if found[-1]["metadata"]["resourceVersion"] == now["metadata"]["resourceVersion"]:
                break
        else:
            raise AssertionError(f"{name}: the watch since {since} never reached {now}")
    return [*found, now]


def _ready(pod: JSON) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


@pytest.fixture
def pods(stack: LocalStack) -> Any:
    made: list[str] = []

    def create(manifest: JSON) -> str:
        call(stack.kube.core.create_namespaced_pod, stack.namespace, manifest)
        made.append(manifest["metadata"]["name"])
        return str(manifest["metadata"]["name"])

    yield create
    for name in made:
        delete(stack.kube.core.delete_namespaced_pod, name, stack.namespace, grace_period_seconds=0)


def test_node_registered_with_gpus(stack: LocalStack) -> None:
    node = call(stack.kube.core.read_node, stack.node_name)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(stack.gpus)
    assert node["metadata"]["labels"][LOCAL_NODE_LABEL] == "true"
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    leases = client.CoordinationV1Api(stack.kube.api)
    lease = call(leases.read_namespaced_lease, stack.node_name, "kube-node-lease")
    assert lease["spec"]["holderIdentity"] == stack.node_name


def test_pod_runs_as_process_with_own_ip_env_probe_and_graceful_delete(
    stack: LocalStack, pods: Callable[[JSON], str], tmp_path: Any
) -> None:
    ready_file = tmp_path / "ready"
    names = [f"srv-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for name in names:
        pods(
            _pod(
                name,
                [sys.executable, "-c", SERVER],
                env=[
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "READY_FILE", "value": str(ready_file)},
                ],
                ports=[{"name": "http", "containerPort": 8080}],
                readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            )
        )
    running = [
        _wait(stack, n, lambda p: p.get("status", {}).get("phase") == "Running") for n in names
    ]
    ips = [p["status"]["podIP"] for p in running]
    assert len(set(ips)) == 2 and all(ip.startswith("127.0.") for ip in ips)
    assert all(p["spec"]["nodeName"] == stack.node_name for p in running)
    # Running but not Ready: the readiness probe gets 503 until the file exists. The probes
    # refused are the events (each server logs its answers); every version of the pod the API
    # server had meanwhile (a watch from Running on) says not Ready.
    for name in names:
        _wait_log(stack, name, lambda text: text.count("answered 503") >= 2)
    for name, pod in zip(names, running, strict=True):
        versions = _versions(stack, name, pod["metadata"]["resourceVersion"])
        assert not any(_ready(v) for v in versions), f"{name} Ready before its file existed"
    ready_file.write_text("ok")
    for name, ip in zip(names, ips, strict=True):
        pod = _wait(stack, name, _ready)
        cs = pod["status"]["containerStatuses"][0]
        assert cs["ready"] and "running" in cs["state"] and cs["restartCount"] == 0
        # The pod's env reached the process: fieldRefs resolved to its own name and IP.
        assert httpx.get(f"http://{ip}:8080/", timeout=5).text == f"{name} {ip}"
    pid = stack.node.pids()[f"{stack.namespace}/{names[0]}"][0]
    assert alive(pid)
    delete(stack.kube.core.delete_namespaced_pod, names[0], stack.namespace)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (alive(pid) or _get_pod(stack, names[0])):
        time.sleep(0.2)
    assert not alive(pid), "process survived pod deletion"
    assert _get_pod(stack, names[0]) is None
    log = next((stack.state_dir / "node" / "pods").glob(f"default_{names[0]}_*/main.log"))
    assert "got SIGTERM" in log.read_text(), "SIGTERM first, not SIGKILL"


def test_failed_process_reports_exit_code_and_message(
    stack: LocalStack, pods: Callable[[JSON], str]
) -> None:
    name = f"fail-{uuid.uuid4().hex[:6]}"
    code = "import sys; print('cannot find libfoo.so: missing symbol bar', flush=True); sys.exit(3)"
    pods(_pod(name, [sys.executable, "-c", code], terminationMessagePolicy="FallbackToLogsOnError"))
    pod = _wait(stack, name, lambda p: p.get("status", {}).get("phase") == "Failed")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3
    assert "missing symbol bar" in term["message"]
    assert not _ready(pod)


def test_restart_policy_always_restarts_with_count(
    stack: LocalStack, pods: Callable[[JSON], str]
) -> None:
    name = f"crash-{uuid.uuid4().hex[:6]}"
    pods(_pod(name, [sys.executable, "-c", "raise SystemExit(1)"], restartPolicy="Always"))
    pod = _wait(
        stack,
        name,
        lambda p: (
            (p.get("status", {}).get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 2
        ),
    )
    cs = pod["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 1
    assert pod["status"]["phase"] == "Running"


def test_nul_byte_in_env_is_a_config_error_not_a_crash(
    stack: LocalStack, pods: Callable[[JSON], str]
) -> None:
    """execve cannot take a NUL byte: the pod waits in CreateContainerConfigError naming the
    variable, and the node keeps running pods (its runner did not die)."""
    bad = f"nul-{uuid.uuid4().hex[:6]}"
    pods(_pod(bad, [sys.executable, "-c", "pass"], env=[{"name": "EVIL", "value": "a\u0000b"}]))

    def config_error(pod: JSON) -> bool:
        state = ((pod.get("status", {}).get("containerStatuses") or [{}])[0]).get("state", {})
        return state.get("waiting", {}).get("reason") == "CreateContainerConfigError"

    pod = _wait(stack, bad, config_error)
    message = pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert "'EVIL'" in message and "NUL" in message
    good = f"after-nul-{uuid.uuid4().hex[:6]}"
    pods(_pod(good, [sys.executable, "-c", "import time; time.sleep(30)"]))
    _wait(stack, good, lambda p: p.get("status", {}).get("phase") == "Running")
    assert config_error(_wait(stack, bad, lambda p: True)), "the NUL pod left its error state"
