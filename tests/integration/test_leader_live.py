"""Leader election on a real API server, with the chart's RBAC (a real token of its operator
ServiceAccount, its Lease Role): one `weightlift operator --leader-elect` reconciles, the other
waits without starting kopf; a killed leader is replaced once its Lease runs out, a stopped one
hands the Lease on at once, and a leader that could not renew exits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.support.cluster import CHART_NAMESPACE, RELEASE, ChartRbac, Kubectl, wait_for
from weightlift.api.labels import DEPLOYMENT_LABEL, FIRST_RECONCILE_ANNOTATION
from weightlift.local.cluster import ClusterInfo
from weightlift.local.history import History, Version
from weightlift.operator.leader import ACQUIRE_JITTER, LEASE_LOST_EXIT

LEASE = f"{RELEASE}-operator"  # the chart's default lease name
DURATION, DEADLINE, RETRY = 4.0, 3.0, 0.5
# Beyond what the Lease's settings bound: the few API requests (a candidate's read of the
# Lease, the write it missed) between two Lease writes, on a busy 2-core machine. Times are
# the candidates' own stamps on the Lease, not when this test happened to look.
API_SLACK = 2.0
FENCE = "test.weightlift.dev/fence"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Candidate:
    """One `weightlift operator --leader-elect` process as the chart's ServiceAccount."""

    def __init__(self, identity: str, kubeconfig: Path, namespace: str, logs: Path) -> None:
        self.identity, self.port, self.metrics_port = identity, _free_port(), _free_port()
        self.log_path = logs / f"candidate-{identity}.log"
        argv = [
            sys.executable, "-m", "weightlift", "operator", "-n", namespace,
            "--model-path-prefix", "/models", "--leader-elect", f"--lease-name={LEASE}",
            f"--lease-namespace={CHART_NAMESPACE}", f"--lease-identity={identity}",
            f"--lease-duration={DURATION}", f"--renew-deadline={DEADLINE}",
            f"--retry-period={RETRY}", "--liveness-host=127.0.0.1",
            f"--liveness-port={self.port}",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "KUBECONFIG": str(kubeconfig),
                    "WEIGHTLIFT_METRICS_HOST": "127.0.0.1",
                    "WEIGHTLIFT_METRICS_PORT": str(self.metrics_port),
                },
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> str:
        """The /healthz answer: the standby's own, or kopf's once it leads ("" if none)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def metrics(self) -> str:
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def candidates(
    operator_kubeconfig: Path, chart_rbac: ChartRbac, namespace: str, state_root: Path
) -> Iterator[dict[str, Any]]:
    made: dict[str, Candidate] = {}

    def start(identity: str) -> Candidate:
        made[identity] = Candidate(identity, operator_kubeconfig, namespace, state_root)
        return made[identity]

    yield {"start": start, "namespace": namespace}
    for c in made.values():
        c.stop()


@pytest.fixture
def leases(api_client: client.ApiClient) -> Iterator[client.CoordinationV1Api]:
    api = client.CoordinationV1Api(api_client)
    _delete_lease(api)  # each test starts with no Lease
    yield api
    _delete_lease(api)


def _delete_lease(api: client.CoordinationV1Api) -> None:
    try:
        api.delete_namespaced_lease(LEASE, CHART_NAMESPACE)
    except client.ApiException as exc:
        if exc.status != 404:
            raise


def lease(api: client.CoordinationV1Api) -> dict[str, Any]:
    raw: Any = api.read_namespaced_lease(LEASE, CHART_NAMESPACE, _preload_content=False)
    doc: dict[str, Any] = json.loads(raw.data)
    return doc


def holder(api: client.CoordinationV1Api) -> str:
    try:
        return str(lease(api)["spec"].get("holderIdentity") or "")
    except client.ApiException:
        return ""


def _model_deployment(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "weightlift.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"uri": f"file:///models/{name}"}, "replicas": 2,
                 "loading": {"waitForSourceSeconds": 0}},
    }  # fmt: skip


def _pods(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"{DEPLOYMENT_LABEL}={name}").items
    return {str(p.metadata.name): str(p.metadata.uid) for p in pods if p.metadata}


def _micro(stamp: str) -> float:
    """A Lease MicroTime in seconds (both candidates stamp with this machine's clock)."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def _holder(change: Version) -> str:
    return str(change.spec.get("holderIdentity") or "")


def _holders(changes: list[Version]) -> list[str]:
    """The Lease's holders in the order they wrote it, each run of renewals once."""
    return [
        h for i, h in enumerate(map(_holder, changes)) if i == 0 or _holder(changes[i - 1]) != h
    ]


def _lease_changes(kubeconfig: Path) -> History:
    """Every write of the Lease from now on (each test starts with none: `leases`)."""
    return History(
        kubeconfig,
        lambda kube: client.CoordinationV1Api(kube.api).list_namespaced_lease,
        CHART_NAMESPACE,
        field_selector=f"metadata.name={LEASE}",
        what="the Lease",
    )


def test_one_reconciles_the_other_takes_over_when_it_dies(
    candidates: dict[str, Any],
    leases: client.CoordinationV1Api,
    core: client.CoreV1Api,
    kubectl: Kubectl,
    cluster: ClusterInfo,
) -> None:
    ns = candidates["namespace"]
    lease_changes = _lease_changes(cluster.kubeconfig)  # every write of the Lease from its first on
    pod_changes = History.pods(cluster.kubeconfig, ns, "solo")
    try:
        a = candidates["start"]("a")
        wait_for(lambda: holder(leases) == "a", 60, "a to take the Lease")
        b = candidates["start"]("b")
        wait_for(lambda: '"standby": true' in b.health(), 60, "b's standby liveness endpoint")
        first = lease(leases)["spec"]
        assert "weightlift_" in b.metrics(), "the standby serves no /metrics"  # scraped as well
        assert first["leaseTransitions"] == 0 and first["leaseDurationSeconds"] == 4

        # Only the leader reconciles: the MD's pods come from a, b never starts kopf.
        kubectl("apply", "-f", "-", input=json.dumps(_model_deployment("solo", ns)))
        wait_for(lambda: len(_pods(core, ns, "solo")) == 2, 60, "the leader to create 2 pods")
        wait_for(lambda: a.health() and "standby" not in a.health(), 30, "kopf's liveness on a")
        wait_for(lambda: _annotation(leases), 30, "a's first reconcile stamped on the Lease")
        assert holder(leases) == "a" and "kopf" not in b.log() and "solo" not in b.log(), b.log()
        pods = _pods(core, ns, "solo")

        # a dies without a word: b takes over once the Lease has run out, and nothing else.
        a.signal(signal.SIGKILL)
        a.proc.wait(timeout=30)
        # b's first pass is stamped on the Lease by its next renewal: all it wrote came before.
        stamped = lease_changes.wait(
            lambda c: _holder(c) == "b" and FIRST_RECONCILE_ANNOTATION in c.annotations,
            60,
            "b's first reconcile stamped on the Lease",
        )
        changes = lease_changes.upto(stamped)
        assert _holders(changes) == ["a", "b"], _holders(changes)  # one hand-over, no release
        took = next(i for i, c in enumerate(changes) if _holder(c) == "b")
        renewed, taken = changes[took - 1].spec, changes[took].spec
        gap = _micro(taken["acquireTime"]) - _micro(renewed["renewTime"])
        print(f"b took the Lease {gap:.2f}s after a's last renewal")
        # Never while a may still act (it stops renew_deadline after its last renewal began)...
        assert gap > DEADLINE, f"b took the Lease {gap:.2f}s after a's last renewal"
        # ...and once it has run out: b sees the last renewal within a (jittered) retry, takes
        # the Lease at its first try a leaseDuration later.
        bound = DURATION + 2 * RETRY * (1 + ACQUIRE_JITTER) + API_SLACK
        assert gap <= bound, f"b took the Lease {gap:.2f}s after a's last renewal (> {bound}s)"
        assert taken["leaseTransitions"] == 1 and taken["acquireTime"] != first["acquireTime"]
        wait_for(lambda: "weightlift_" in b.metrics(), 60, "the new leader's /metrics")
        # No pod of solo made or deleted since a made its two, up to b's first pass and beyond.
        fence = _fence(core, pod_changes, ns, next(iter(pods)))
        churn = [(c.type, c.name) for c in pod_changes.upto(fence) if c.type != "MODIFIED"]
        assert sorted(churn) == sorted(("ADDED", name) for name in pods), churn
    finally:
        lease_changes.close()
        pod_changes.close()
    kubectl("delete", "-n", ns, "md/solo", "--timeout=60s")  # b handles the finalizer


def _fence(core: client.CoreV1Api, pods: History, namespace: str, pod: str) -> Version:
    """Annotate `pod` and wait for that change: every earlier change of the pods came before."""
    mark = f"{time.monotonic_ns()}"
    core.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": {FENCE: mark}}})
    return pods.wait(lambda c: c.annotations.get(FENCE) == mark, 30, "the fence annotation")


def _annotation(api: client.CoordinationV1Api) -> str:
    return str(
        (lease(api)["metadata"].get("annotations") or {}).get(FIRST_RECONCILE_ANNOTATION, "")
    )


def test_a_stopped_leader_hands_the_lease_on_at_once(
    candidates: dict[str, Any], leases: client.CoordinationV1Api, cluster: ClusterInfo
) -> None:
    lease_changes = _lease_changes(cluster.kubeconfig)
    try:
        a = candidates["start"]("a")
        wait_for(lambda: holder(leases) == "a", 60, "a to take the Lease")
        b = candidates["start"]("b")
        wait_for(lambda: '"standby": true' in b.health(), 60, "b waiting")
        # kopf runs (and handles SIGTERM) once a's own liveness endpoint answers.
        wait_for(lambda: a.health() and "standby" not in a.health(), 60, "kopf's liveness on a")
        a.signal(signal.SIGTERM)  # a rollout or a drain: kopf stops, then the Lease is released
        assert a.proc.wait(timeout=30) == 0, a.log()
        taken = lease_changes.wait(lambda c: _holder(c) == "b", 30, "b to take the Lease")
        changes = lease_changes.upto(taken)
    finally:
        lease_changes.close()
    assert "released Lease" in a.log()
    assert _holders(changes) == ["a", "", "b"], _holders(changes)  # a released it, b took it
    renewed = next(c.spec for c in reversed(changes) if _holder(c) == "a")  # a's last renewal
    released, took = changes[-2].spec, changes[-1].spec
    # A release needs no expiry: b takes it before a's last renewal would have run out...
    since = _micro(took["acquireTime"]) - _micro(renewed["renewTime"])
    assert since < DURATION, f"b took the Lease {since:.2f}s after a's last renewal"
    # ...at its next try: within a jittered retry of the read that still saw a, plus that
    # read's and the release's latency.
    after = _micro(took["acquireTime"]) - _micro(released["renewTime"])
    print(f"b took the Lease {after:.2f}s after its release, {since:.2f}s after a's last renewal")
    bound = RETRY * (1 + ACQUIRE_JITTER) + API_SLACK
    assert after <= bound, f"b took the released Lease {after:.2f}s after (> {bound}s)"
    assert took["leaseTransitions"] == 1


def test_a_leader_that_cannot_renew_exits(
    candidates: dict[str, Any], leases: client.CoordinationV1Api
) -> None:
    """A leader frozen past its Lease (a stalled node) finds another holder when it wakes: it
    exits at once (status 3) instead of acting on a Lease it lost; its pod restarts as standby."""
    a = candidates["start"]("a")
    wait_for(lambda: holder(leases) == "a", 60, "a to take the Lease")
    candidates["start"]("b")
    a.signal(signal.SIGSTOP)
    wait_for(lambda: holder(leases) == "b", 60, "b to take the Lease from the frozen a")
    a.signal(signal.SIGCONT)
    assert a.proc.wait(timeout=30) == LEASE_LOST_EXIT, a.log()
    assert "lost Lease" in a.log()
    assert holder(leases) == "b"


def test_chart_rbac_grants_the_lease_and_nothing_more(
    kubectl: Kubectl, chart_rbac: ChartRbac
) -> None:
    sa = chart_rbac.user

    def can(verb: str, what: str, namespace: str = CHART_NAMESPACE) -> bool:
        out = kubectl(
            "auth", "can-i", verb, what, f"--as={sa}", "-n", namespace, check=False
        ).stdout.strip()
        return out == "yes"

    assert can("get", f"leases.coordination.k8s.io/{LEASE}")
    assert can("update", f"leases.coordination.k8s.io/{LEASE}")
    assert can("create", "leases.coordination.k8s.io")
    for verb, what in [
        ("get", "leases.coordination.k8s.io/kube-scheduler"),
        ("update", "leases.coordination.k8s.io/other"),
        ("delete", f"leases.coordination.k8s.io/{LEASE}"),
        ("patch", f"leases.coordination.k8s.io/{LEASE}"),
        ("list", "leases.coordination.k8s.io"),
        ("watch", "leases.coordination.k8s.io"),
    ]:
        assert not can(verb, what), f"{verb} {what}"
    assert not can("create", "leases.coordination.k8s.io", "kube-system")
