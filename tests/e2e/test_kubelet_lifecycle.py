"""The builtin lifecycle on the real node: the chart's operator runs as a container under the
pinned kubelet (in-cluster config through the `kubernetes` Service), three replicas of the demo
model run as containers of the worker image pulled from the stack's registry: a storage source
and two standby targets that pull P2P over the pod network, all Ready with identical outputs.
Each worker lives in its own PID, IPC and network namespaces under its pod's memory cgroup.
Needs root, `make node` and `make images`. Then two vLLM replicas of the worker-vllm image in
the same stack: a source from storage and a target that waits in Standby and pulls P2P and its
source's compiled program, both giving transformers' greedy text through the pod network; once
they are deleted, a new replica of the model installs the node store's entry instead of
compiling (needs `make vllm-env` for the tiny Llama). Then two Triton replicas of the
worker-triton image (its tritonserver and Python backend run vLLM): a source from storage and a
target that pulls P2P with every checksum verified, each Ready only once its inference probe
passed through Triton's generate."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_kubelet_node import _require_node
from tests.e2e.test_prometheus import _require_prometheus
from tests.support.e2e import READY_TIMEOUT, held_source
from tests.support.kubelet import node_stack
from tests.support.promchecks import (
    Deployed,
    check_dashboard,
    check_loaded_bytes,
    check_service_discovery,
    check_time_to_ready,
)
from tests.support.vllm import READY_TIMEOUT as VLLM_READY_TIMEOUT
from tests.support.vllm import require_vllm_python, tiny_llm
from weightlift.local.kube import call
from weightlift.local.kubeletnode import KubeletNode
from weightlift.local.kubeletnode.config import SYNC_FREQUENCY_SECONDS
from weightlift.local.observe import Observer, complete, generate, infer
from weightlift.local.prometheus import NAMESPACE as PROM_NAMESPACE
from weightlift.local.prometheus import LocalPrometheus
from weightlift.local.prometheus_pod import POD as PROM_POD
from weightlift.local.stack import (
    VLLM_ENV,
    LocalStack,
    engine_image,
    make_demo_model,
    model_deployment,
    vllm_engine_args,
)
from weightlift.worker.engines.vllm.compile_store import ARCHIVE
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
NAME = "kube-life"
VLLM = "kube-vllm"
TRITON = "kube-triton"
REPLICAS = 3
MODEL_MB = 8.0
# A standby target's hand-off reaches it through the kubelet's downwardAPI refresh: on the pod
# update event at once (test_kubelet_node times that), else at the pod's next periodic sync,
# which the kubelet's pod workers jitter up to 1.5 x syncFrequency; +2 s for the kubelet's 1 s
# sync tick and the worker's file poll. A fixed few seconds measured how busy 2 cores were.
HANDOFF_BOUND_SECONDS = 1.5 * SYNC_FREQUENCY_SECONDS + 2.0
# The first test pays for the stack: a cold registry cache compresses and pushes the worker
# image (6.3 GB, torch with its CUDA wheels), and containerd pulls and unpacks it.
pytestmark = pytest.mark.timeout(1800)


def _require_images(stack_images: tuple[str, ...]) -> None:
    import subprocess

    absent = [
        i
        for i in stack_images
        if subprocess.run(
            ["buildah", "inspect", "--type", "image", i], capture_output=True
        ).returncode
    ]
    if absent:
        msg = f"images missing: {', '.join(absent)}; run `make images`"
        if os.environ.get("WEIGHTLIFT_REQUIRE_NODE"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The models' folder: the operator's hostpath prefix, mounted into the pods."""
    return tmp_path_factory.mktemp("kmodels")


@pytest.fixture(scope="module")
def model(models: Path) -> tuple[Path, JSON]:
    out = models / "model"
    return out, make_demo_model(out, MODEL_MB)


@pytest.fixture(scope="module")
def llm(models: Path) -> tuple[Path, JSON]:
    out = models / "llm"
    return out, tiny_llm(require_vllm_python(), out)


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[LocalStack]:
    _require_node()
    stack = LocalStack(
        tmp_path_factory.mktemp("klife") / "stack",
        node_kind="kubelet",
        node_name="kubelet-life",
        # The builtin deployment's 3 (4 after the failover test's scale-up), the vLLM pair's 2
        # (then the Triton pair's) and the unpullable image's 1, side by side.
        gpus=7,
        install="helm",
        model_path_prefixes=(str(models),),
    )
    # worker-vllm shares the worker's layers: the registry and containerd hold them once.
    # worker-triton stands on worker-vllm's layers: only its tritonserver layers are new.
    stack.images = (*stack.node_images(), engine_image("vLLM"), engine_image("Triton"))
    _require_images(stack.node_images())
    yield from node_stack(stack)


@pytest.fixture(scope="module")
def kprom(
    kstack: LocalStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    """Prometheus as a pod of the node (local/prometheus_pod.py), up before the deployment."""
    _require_prometheus()
    with LocalPrometheus(kstack, tmp_path_factory.mktemp("kprom")) as prom:
        yield prom


@pytest.fixture(scope="module")
def deployed(kstack: LocalStack, kprom: LocalPrometheus, model: tuple[Path, JSON]) -> Deployed:
    model_dir, probe = model
    applied_at = time.time()
    kstack.apply(model_deployment(NAME, model_dir, replicas=REPLICAS, probe=probe))
    obs = Observer(kstack, NAME)
    obs.wait_ready(READY_TIMEOUT)
    return Deployed(obs, model_dir, applied_at, NAME, REPLICAS, MODEL_MB)


@pytest.fixture(scope="module")
def ready(deployed: Deployed) -> Observer:
    return deployed.obs


def test_operator_runs_as_a_container_in_cluster(kstack: LocalStack) -> None:
    assert kstack.release is not None
    pod = kstack.release.operator_pod()
    assert pod is not None and pod["spec"]["nodeName"] == kstack.node_name
    (pid, *_) = kstack.node.pids()[f"{kstack.release.namespace}/{pod['metadata']['name']}"]
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert "KUBECONFIG" not in env
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"  # the `kubernetes` Service
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    # Its API requests went through the Service to the API server's address on the node link.
    ep = call(kstack.kube.core.read_namespaced_endpoints, "kubernetes", "default")
    node = kstack.node
    assert isinstance(node, KubeletNode)
    assert ep["subsets"][0]["addresses"][0]["ip"] == node.net.host_ip


def test_source_and_p2p_targets_ready_with_identical_outputs(
    ready: Observer, model: tuple[Path, JSON]
) -> None:
    _, probe = model
    rows = ready.replica_statuses()
    assert len(rows) == 3 and all(r["ready"] for r in rows), rows
    sources = [r for r in rows if r["loadedFrom"] == "storage:hostpath"]
    targets = [r for r in rows if str(r["loadedFrom"]).startswith("peer:")]
    assert len(sources) == 1 and len(targets) == 2, rows
    summary = {r["name"]: r for r in ready.summary()["replicas"]}
    outputs = [
        infer(summary[r["name"]]["endpoint"], NAME, probe["request"])["outputs"] for r in rows
    ]
    assert all(o == outputs[0] for o in outputs)
    node_net = ready.stack.node.net  # type: ignore[attr-defined]
    prefix = node_net.pod_cidr.rsplit(".", 1)[0] + "."
    assert all(summary[r["name"]]["endpoint"].split("//")[1].startswith(prefix) for r in rows)


def test_each_worker_has_its_own_namespaces_and_memory_cgroup(
    ready: Observer, kstack: LocalStack
) -> None:
    node = kstack.node
    assert isinstance(node, KubeletNode)
    seen: dict[str, set[str]] = {"pid": set(), "ipc": set(), "net": set()}
    for pod in kstack.pods(NAME):
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        pids = node.pids()[key]
        assert pids, key
        pid = pids[0]
        for ns in seen:
            mine = os.readlink(f"/proc/{pid}/ns/{ns}")
            assert mine != os.readlink(f"/proc/self/ns/{ns}"), (key, ns)
            seen[ns].add(mine)
        memory = next(
            ln.split(":", 2)[2]
            for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            if ":memory:" in ln
        )
        assert f"/pod{pod['metadata']['uid']}/" in memory, memory
        assert memory.startswith(f"{node.cgroup_root}/kubepods/"), memory
        status = Path(f"/proc/{pid}/status").read_text()
        assert "\nUid:\t1000\t" in status  # runAsUser, for real
    for ns, values in seen.items():
        assert len(values) == 3, (ns, values)  # one each, none shared


def test_prometheus_as_a_pod_scrapes_the_operator_pods_and_workers(
    kstack: LocalStack, kprom: LocalPrometheus, deployed: Deployed
) -> None:
    """Issue 34 on the real node: Prometheus is a pod in its own network namespace, found by
    its ServiceAccount's in-cluster discovery; the operator pods are found through the metrics
    Service's EndpointSlices and the workers by their labels, all scraped over the pod network."""
    assert kprom.proc is None and kprom.pod_ip is not None
    (pid, *_) = kstack.node.pids()[f"{PROM_NAMESPACE}/{PROM_POD}"]
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    assert os.stat(f"/proc/{pid}").st_uid != 0
    assert kstack.release is not None and len(kstack.release.live_operator_pods()) == 2
    check_service_discovery(kstack, kprom, deployed)
    check_time_to_ready(kstack, kprom, deployed)
    check_loaded_bytes(kstack, kprom, deployed)
    check_dashboard(kprom, deployed)


@dataclass(frozen=True)
class HeldStart:
    """The vLLM pair's source, held at the fault gate before its storage load until its target
    said Standby; `released`: when it was let go (wall clock, the host's, as the workers')."""

    source: str
    released: float


@pytest.fixture(scope="module")
def vllm_pair(kstack: LocalStack, llm: tuple[Path, JSON]) -> tuple[Observer, HeldStart]:
    """Compiled (torch Inductor builds C++ with the image's g++): the source compiles and
    publishes its program to its target and to the node store. The source waits at the fault
    gate (the device plugin mounts it into the containers) before its load, alive and probed,
    until the target's vLLM waits at its weight step in Standby: the target's Standby comes
    first on any machine, where a fast source could otherwise be Ready before it."""
    obs = Observer(kstack, VLLM)
    obs.watch_handoffs()
    try:
        with held_source(kstack, VLLM) as hold:
            kstack.apply(_vllm_manifest(llm, VLLM, replicas=2))
            source = hold.pod(VLLM_READY_TIMEOUT)
            obs.wait(
                lambda o: any(
                    r.get("name") != source and r.get("phase") == "Standby"
                    for r in o.replica_statuses()
                ),
                # The held source lets go by itself after HOLD_LIMIT_SECONDS.
                faultgate.HOLD_LIMIT_SECONDS - 10,
                f"{VLLM}'s target in Standby while its source is held",
            )
            still = faultgate.waiting_at(hold.gate, VLLM, faultgate.STORAGE_LOAD)
            assert [a.pod for a in still] == [source], still
            released = time.time()  # before the release: the source cannot start before it
        obs.wait_ready(VLLM_READY_TIMEOUT)
    finally:
        obs.close()
    return obs, HeldStart(source, released)


@pytest.fixture(scope="module")
def vllm_ready(vllm_pair: tuple[Observer, HeldStart]) -> Observer:
    return vllm_pair[0]


def _deploy_vllm(kstack: LocalStack, llm: tuple[Path, JSON], name: str, replicas: int) -> Observer:
    obs = Observer(kstack, name)
    obs.watch_handoffs()
    kstack.apply(_vllm_manifest(llm, name, replicas))
    try:
        obs.wait_ready(VLLM_READY_TIMEOUT)
    finally:
        obs.close()
    return obs


def _vllm_manifest(llm: tuple[Path, JSON], name: str, replicas: int) -> JSON:
    model_dir, probe = llm
    return model_deployment(
        name,
        model_dir,
        replicas=replicas,
        probe=probe,
        engine="vLLM",
        engine_args=vllm_engine_args(eager=False),
        env=VLLM_ENV,
        hook_library=None,
        image=engine_image("vLLM"),
        # Its wait begins at the pods' creation: the pull of worker-vllm's own layers and vLLM's
        # start on 2 busy cores come first (demo.REAL_NODE_WAIT_FOR_SOURCE).
        wait_for_source_seconds=int(VLLM_READY_TIMEOUT),
    )


def _worker_marks(endpoint: str) -> dict[str, float]:
    """A worker's own timeline: wall-clock marks, the host's clock (containers share it)."""
    marks = httpx.get(f"{endpoint}/weightlift/v1/status", timeout=10).json()["timeline"]
    return {str(k): float(v) for k, v in marks.items()}


def test_vllm_source_and_standby_target_ready_with_the_same_completion(
    vllm_pair: tuple[Observer, HeldStart], llm: tuple[Path, JSON], kstack: LocalStack
) -> None:
    _, probe = llm
    vllm_ready, held = vllm_pair
    rows = vllm_ready.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] and r["probe"]["passed"] for r in rows), rows
    source = next(r for r in rows if r["loadedFrom"] == "storage:hostpath")
    assert source["name"] == held.source, (held, rows)
    target = next(r for r in rows if r["name"] != source["name"])
    assert target["loadedFrom"] == f"peer:{source['name']}", rows
    assert source["compileCache"].startswith("miss (") and target["compileCache"] == "hit (peer)"
    assert target["bytesLoaded"] == target["bytesTotal"] == source["bytesTotal"] > 0, rows
    summary = {r["name"]: r for r in vllm_ready.summary()["replicas"]}
    src, tgt = summary[source["name"]], summary[target["name"]]
    # Standby, in this order on any machine: the target's vLLM waited at its weight step while
    # its source was held (vllm_pair), the source began its load only once let go ("fetch":
    # the worker's mark on leaving the gate, rounded to ms) and was Ready after that; then the
    # kubelet's downwardAPI refresh handed the target its source.
    released = held.released - vllm_ready.applied
    loading = _worker_marks(str(src["endpoint"]))["fetch"] - vllm_ready.applied
    print(
        f"since the apply: target Standby {tgt['standbyAt']} s, source let go {released:.3f} s,"
        f" loading {loading:.3f} s, Ready {src['readyAt']} s; hand-off {tgt['handoffSeconds']} s"
    )
    assert tgt["standbyAt"] < released <= loading + 0.001 < src["readyAt"], (
        released,
        loading,
        src,
        tgt,
    )
    assert 0 <= tgt["handoffSeconds"] <= HANDOFF_BOUND_SECONDS, tgt
    texts = [complete(r["openaiEndpoint"], VLLM, probe["completion"]) for r in (src, tgt)]
    assert texts == [probe["completion"]["expectedText"]] * 2
    node = kstack.node
    assert isinstance(node, KubeletNode)
    prefix = node.net.pod_cidr.rsplit(".", 1)[0] + "."
    assert all(str(r["openaiEndpoint"]).split("//")[1].startswith(prefix) for r in (src, tgt))
    images = {c["image"] for p in kstack.pods(VLLM) for c in p["spec"]["containers"]}
    assert images == {engine_image("vLLM")}, images


def test_a_new_vllm_replica_installs_the_node_store_entry_the_deleted_pair_left(
    vllm_ready: Observer, llm: tuple[Path, JSON], kstack: LocalStack
) -> None:
    """Issue 33 on the real node: the store is a hostPath, root-owned as the kubelet makes it;
    the chart's node-prep DaemonSet hands it to uid 1000, so the source (a non-root container)
    stored its compiled program there. It outlives the pair: a new deployment's first replica,
    with no Ready peer, installs it verified and does not compile."""
    store = Path(kstack.compile_store)
    deadline = time.monotonic() + 60
    while not (archives := sorted(store.glob(f"*/*/{ARCHIVE}"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert archives, f"nothing stored in {store}: {[str(p) for p in store.rglob('*')]}"
    assert {p.stat().st_uid for p in archives} == {1000}  # written by the worker's uid
    assert kstack.release is not None
    # The chart's node-prep DaemonSet handed the store over once, and cleanly.
    (prep,) = call(
        kstack.kube.core.list_namespaced_pod,
        kstack.release.namespace,
        label_selector="app.kubernetes.io/name=weightlift-node-prep",
    )["items"]
    (chown,) = prep["status"]["initContainerStatuses"]
    assert chown["state"]["terminated"]["exitCode"] == 0 and chown["restartCount"] == 0, chown
    kstack.delete_md(VLLM)
    # Gone with its finalizer, not just its pods: until then its status still lists sources.
    vllm_ready.wait(lambda o: not o.pods and o.md is None, 120, f"{VLLM} to go")
    again = f"{VLLM}-again"
    try:
        obs = _deploy_vllm(kstack, llm, again, replicas=1)
        (row,) = obs.replica_statuses()
        assert row["compileCache"] == "hit (store)" and row["role"] == "Source", row
        worker_log = "".join(
            p.read_text(errors="replace")
            for p in kstack.node.pod_logs(kstack.namespace, row["name"])
        )
        assert "from the node store installed" in worker_log, worker_log[-3000:]
        (served,) = obs.summary()["replicas"]
        _, probe = llm
        text = complete(served["openaiEndpoint"], again, probe["completion"])
        assert text == probe["completion"]["expectedText"]
    finally:
        kstack.delete_md(again)


@pytest.fixture(scope="module")
def triton_pair(kstack: LocalStack, llm: tuple[Path, JSON]) -> Iterator[tuple[Observer, list[str]]]:
    """Two Triton replicas of worker-triton; deleted after its test (the cores go back to the
    tests after it). Also what each poll saw: a replica Ready whose probe had not passed."""
    model_dir, probe = llm
    manifest = model_deployment(
        TRITON,
        model_dir,
        replicas=2,
        probe=probe,
        engine="Triton",
        engine_args=vllm_engine_args(eager=True),
        env=VLLM_ENV,
        hook_library=None,
        image=engine_image("Triton"),
        wait_for_source_seconds=int(VLLM_READY_TIMEOUT),
    )
    early: list[str] = []

    def ready_before_its_probe(o: Observer) -> None:
        early.extend(
            f"{r['name']}: {r.get('probe')}"
            for r in o.replica_statuses()
            if r.get("ready") and not (r.get("probe") or {}).get("passed")
        )

    obs = Observer(kstack, TRITON)
    kstack.apply(manifest)
    try:
        obs.wait_ready(2 * VLLM_READY_TIMEOUT, tick=ready_before_its_probe)
        yield obs, early
    finally:
        kstack.delete_md(TRITON)
        obs.wait(lambda o: not o.pods and o.md is None, 120, f"{TRITON} to go")


def test_triton_source_and_p2p_target_of_worker_triton_ready_after_their_probes(
    triton_pair: tuple[Observer, list[str]], llm: tuple[Path, JSON], kstack: LocalStack
) -> None:
    """Issue 47 on the real node: tritonserver (its Python backend runs vLLM with weightlift's
    load format) in containers the kubelet pulled from the stack's registry."""
    obs, early = triton_pair
    _, probe = llm
    rows = obs.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] and r["probe"]["passed"] for r in rows), rows
    assert not early, early  # never Ready before the inference probe passed
    source = next(r for r in rows if r["loadedFrom"] == "storage:hostpath")
    target = next(r for r in rows if r["name"] != source["name"])
    assert target["role"] == "Target" and target["loadedFrom"] == f"peer:{source['name']}", rows
    assert target["bytesLoaded"] == target["bytesTotal"] == source["bytesTotal"] > 0, rows
    summary = {r["name"]: r for r in obs.summary()["replicas"]}
    # The P2P pull verified every tensor's checksum (a mismatch fails the pull): its verify step.
    report = httpx.get(f"{summary[target['name']]['endpoint']}/weightlift/v1/status", timeout=10)
    assert "verify" in report.json()["loadPhases"], report.json()
    # Each replica's own tritonserver, over the pod network: transformers' greedy text.
    texts = [
        generate(summary[r["name"]]["tritonEndpoint"], TRITON, probe["completion"]) for r in rows
    ]
    assert texts == [probe["completion"]["expectedText"]] * 2, texts
    node = kstack.node
    assert isinstance(node, KubeletNode)
    prefix = node.net.pod_cidr.rsplit(".", 1)[0] + "."
    assert all(
        str(summary[r["name"]]["tritonEndpoint"]).split("//")[1].startswith(prefix) for r in rows
    )
    images = {c["image"] for p in kstack.pods(TRITON) for c in p["spec"]["containers"]}
    assert images == {engine_image("Triton")}, images
    # tritonserver runs inside the target's container (its PID namespace, not the host's).
    (worker, *_) = node.pids()[f"{kstack.namespace}/{target['name']}"]
    servers = [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _comm(p) == "tritonserver" and _same_pidns(p, worker)
    ]
    assert len(servers) == 1, servers


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _same_pidns(proc: Path, pid: int) -> bool:
    try:
        return os.readlink(proc / "ns" / "pid") == os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return False


def test_an_image_that_cannot_be_pulled_is_named_in_status(
    kstack: LocalStack, model: tuple[Path, JSON]
) -> None:
    """A tag the registry does not have: the replica stays Pending, and the status names the
    image and the kubelet's reason (ErrImagePull, then ImagePullBackOff)."""
    model_dir, probe = model
    image = "ghcr.io/weightlift/worker:no-such-tag"
    kstack.apply(model_deployment("kube-badimg", model_dir, replicas=1, probe=probe, image=image))
    obs = Observer(kstack, "kube-badimg")

    def named(o: Observer) -> bool:
        message = str(o.status().get("message") or "")
        return image in message and ("ErrImagePull" in message or "ImagePullBackOff" in message)

    try:
        obs.wait(named, 120, "the status to name the unpullable image")
        status = obs.status()
        assert status["phase"] == "Pending", status
        (row,) = obs.replica_statuses()
        assert image in row["message"] and not row["ready"], row
    finally:
        kstack.delete_md("kube-badimg")
        obs.wait(lambda o: not o.pods, 120, "kube-badimg's pod to go")


def test_the_standby_operator_pod_takes_over_when_the_leader_pod_dies(
    kstack: LocalStack, ready: Observer
) -> None:
    """Issue 34's failover on the real node: the chart's two operator pods; the leader's pod is
    deleted with no grace period (as a drain or an eviction that will not wait) just as a
    scale-up asks for a fourth replica. The kubelet stops its container, whose operator gives up
    its Lease on the way out; the other pod takes it and finishes the scale-up: the three
    replicas keep their pods, the new one pulls from a peer. (A leader that dies without a word
    is bench chaos' leader-sigkill-standby-takes-over: the Lease has to run out there.)"""
    release = kstack.release
    assert release is not None
    leader = release.operator_pod()
    assert leader is not None and release.lease_holder() == leader["metadata"]["name"]
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kstack.pods(NAME)}
    killed_at = time.monotonic()
    call(
        kstack.kube.core.delete_namespaced_pod,
        leader["metadata"]["name"],
        release.namespace,
        grace_period_seconds=0,
    )
    kstack.scale_md(NAME, REPLICAS + 1)
    ready.wait(
        lambda o: release.lease_holder() not in (None, leader["metadata"]["name"]),
        60,
        "another operator pod to hold the Lease",
    )
    takeover = time.monotonic() - killed_at
    ready.wait_ready(READY_TIMEOUT)
    rows = {r["name"]: r for r in ready.replica_statuses()}
    assert len(rows) == REPLICAS + 1 and all(r["ready"] for r in rows.values()), rows
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kstack.pods(NAME)}
    assert {n: now[n] for n in before} == before, (before, now)  # none replaced
    (new,) = set(now) - set(before)
    assert str(rows[new]["loadedFrom"]).startswith("peer:"), rows[new]
    print(f"operator failover on the real node: Lease taken {takeover:.1f}s after the delete")
