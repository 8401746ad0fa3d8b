"""The process node itself: the Node object, its lease and heartbeats, the pod watch, and one
PodRunner per pod bound to it."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from weightlift.api.times import now_micro, now_rfc3339
from weightlift.local.kube import (
    JSON,
    KUBE_ERRORS,
    MERGE,
    STRATEGIC,
    Kube,
    call,
    delete,
    describe,
    get_or_none,
)
from weightlift.local.processnode.base import (
    LEASE_SECONDS,
    LOCAL_NODE_LABEL,
    PROCESS_NODE_ANNOTATION,
    RUNTIME_VERSION,
    NodeConfig,
    key,
)
from weightlift.local.processnode.runner import PodRunner
from weightlift.local.procs import signal_group

log = logging.getLogger("weightlift.processnode")
LEASE_NAMESPACE = "kube-node-lease"
# A watch the API server ends after this long (then it is opened again from its last version).
WATCH_SECONDS = 30
WATCH_ERRORS: tuple[type[Exception], ...] = (*KUBE_ERRORS, ValueError)


class ProcessNode:
    """Register a Node and run the pods bound to it as processes. `start()` returns at once.

    >>> with ProcessNode(kubeconfig, "local-0", state_dir) as node:
    ...     ...  # pods scheduled to local-0 now run as processes
    """

    def __init__(
        self,
        kubeconfig: Path,
        name: str,
        state_dir: Path,
        **options: Any,
    ) -> None:
        self.config = NodeConfig(name=name, state_dir=Path(state_dir), **options)
        self.kubeconfig = Path(kubeconfig)
        self.kube = Kube(self.kubeconfig, "process-node")
        self.leases = client.CoordinationV1Api(self.kube.api)
        self.host_ip = "127.0.0.1"
        self.stopping = threading.Event()
        self._runners: dict[str, PodRunner] = {}  # uid -> runner
        self._ips: dict[str, str] = {}  # uid -> pod IP
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._boot_id = str(uuid.uuid4())
        self._registered_at = now_rfc3339()  # conditions only transition at registration
        self._ip_iter = self._ip_candidates()

    # -- lifecycle
    def __enter__(self) -> ProcessNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self._register()
        self._renew_lease()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            t = threading.Thread(target=target, name=f"node-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "process node %s registered (%d GPUs advertised)", self.config.name, self.config.gpus
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Kill every pod process (SIGTERM, then SIGKILL), stop heartbeats, drop the Node."""
        self.stopping.set()
        with self._lock:
            runners = list(self._runners.values())
        for r in runners:
            r._wake.set()
        deadline = time.monotonic() + timeout
        for r in runners:
            r.join(max(0.1, deadline - time.monotonic()))
        for r in runners:  # a runner stuck in an API call: kill its processes ourselves
            for c in r.containers:
                if c.proc is not None and c.proc.poll() is None:
                    signal_group(c.proc, signal.SIGKILL)
                    c.proc.wait()
        if self.config.delete_node_on_stop:
            with contextlib.suppress(*KUBE_ERRORS):
                delete(self.kube.core.delete_node, self.config.name)
            with contextlib.suppress(*KUBE_ERRORS):
                delete(self.leases.delete_namespaced_lease, self.config.name, LEASE_NAMESPACE)
        self.kube.close()

    def wait(self) -> None:
        while not self.stopping.wait(1.0):
            pass

    # -- introspection (tests, demo)
    @property
    def name(self) -> str:
        return self.config.name

    def pod_logs(self, namespace: str, pod: str) -> list[Path]:
        return sorted(self.config.state_dir.glob(f"pods/{namespace}_{pod}_*/*.log"))

    def pods(self) -> dict[str, PodRunner]:
        """namespace/name -> runner of the pods this node currently runs."""
        with self._lock:
            return {f"{r.namespace}/{r.pod_name}": r for r in self._runners.values()}

    def pids(self) -> dict[str, list[int]]:
        return {k: r.pids() for k, r in self.pods().items()}

    @property
    def fault_gate_dir(self) -> Path:
        """Where the chaos harness arms holds on its workers' pulls (worker/p2p/faultgate.py)."""
        return self.config.state_dir / "faultgate"

    def event(self, pod: JSON, kind: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about a pod, as the kubelet would (best effort)."""
        meta = pod["metadata"]
        ts = now_rfc3339()
        body: JSON = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "kind": "Pod",
                "apiVersion": "v1",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "type": kind,
            "reason": reason,
            "message": message[:1000],
            "source": {"component": "weightlift-process-node", "host": self.config.name},
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        try:
            call(self.kube.core.create_namespaced_event, meta["namespace"], body)
        except KUBE_ERRORS as exc:
            log.debug("event not posted: %s", describe(exc))

    # -- node object
    def _node_object(self) -> JSON:
        cfg = self.config
        try:
            version = call(client.VersionApi(self.kube.api).get_code).get("gitVersion", "v0.0.0")
        except KUBE_ERRORS:
            version = "v0.0.0"
        resources = {
            "cpu": cfg.cpu,
            "memory": cfg.memory,
            "pods": str(cfg.max_pods),
            "ephemeral-storage": "100Gi",
            "nvidia.com/gpu": str(cfg.gpus),
        }
        labels = {
            "kubernetes.io/hostname": cfg.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "process",
            LOCAL_NODE_LABEL: "true",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": cfg.gpu_product,
            "nvidia.com/gpu.count": str(cfg.gpus),
            **cfg.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": cfg.name,
                "labels": labels,
                "annotations": {
                    PROCESS_NODE_ANNOTATION: "true",
                    "node.alpha.kubernetes.io/ttl": "0",
                },
            },
            "spec": {},
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": cfg.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {
                    "machineID": hashlib.md5(cfg.name.encode()).hexdigest(),
                    "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, cfg.name)),
                    "bootID": self._boot_id,
                    "kernelVersion": os.uname().release,
                    "osImage": "weightlift process node (local mode, no containers)",
                    "containerRuntimeVersion": RUNTIME_VERSION,
                    "kubeletVersion": version,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
                "conditions": self._conditions(),
            },
        }

    def _conditions(self) -> list[JSON]:
        ts = now_rfc3339()
        rows = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": "weightlift process node is posting ready status"
                if t == "Ready"
                else "",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": self._registered_at,
            }
            for t, s, r in rows
        ]

    def _register(self) -> None:
        body = self._node_object()
        name, core = self.config.name, self.kube.core
        existing = get_or_none(core.read_node, name)
        if existing is None:
            call(core.create_node, body)
        else:
            annotations = existing["metadata"].get("annotations", {})
            if PROCESS_NODE_ANNOTATION not in annotations:
                raise RuntimeError(
                    f"node {self.config.name} exists and is not a process node; pick another name"
                )
            patch = {"metadata": body["metadata"], "spec": {"taints": None}}
            call(core.patch_node, name, patch, _content_type=STRATEGIC)
        self._patch_status({"status": body["status"]})
        self.uid = call(core.read_node, name)["metadata"]["uid"]

    def _patch_status(self, patch: JSON) -> None:
        call(self.kube.core.patch_node_status, self.config.name, patch, _content_type=STRATEGIC)

    def _renew_lease(self) -> None:
        name = self.config.name
        spec = {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now_micro(),
        }
        patch_lease = self.leases.patch_namespaced_lease
        try:
            call(patch_lease, name, LEASE_NAMESPACE, {"spec": spec}, _content_type=MERGE)
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
        if get_or_none(self.kube.core.read_namespace, LEASE_NAMESPACE) is None:
            with contextlib.suppress(ApiException):
                call(self.kube.core.create_namespace, {"metadata": {"name": LEASE_NAMESPACE}})
        owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.uid}
        lease = {"metadata": {"name": name, "ownerReferences": [owner]}, "spec": spec}
        call(self.leases.create_namespaced_lease, LEASE_NAMESPACE, lease)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.config.heartbeat_seconds):
            try:
                self._renew_lease()
                self._patch_status({"status": {"conditions": self._conditions()}})
            except KUBE_ERRORS as exc:
                if self.stopping.is_set():
                    return
                log.warning("heartbeat failed: %s", describe(exc))

    # -- pods
    def _watch_loop(self) -> None:
        selector = f"spec.nodeName={self.config.name}"
        list_pods = self.kube.core.list_pod_for_all_namespaces
        # "object": events carry the pods as the API server sent them (dicts, no models).
        pods = watch.Watch(return_type="object")
        while not self.stopping.is_set():
            try:
                listing = call(list_pods, field_selector=selector)
                rv = listing["metadata"]["resourceVersion"]
                self._sync({p["metadata"]["uid"]: p for p in listing["items"]})
                while not self.stopping.is_set():
                    # An ERROR event (410 Gone: rv too old) raises ApiException: list again.
                    for event in pods.stream(
                        list_pods,
                        field_selector=selector,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=WATCH_SECONDS,
                        _request_timeout=(10, WATCH_SECONDS + 15),
                    ):
                        obj = event["raw_object"]
                        rv = obj["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._on_pod(obj)
                        elif event["type"] == "DELETED":
                            self._on_deleted(obj)
                        if self.stopping.is_set():
                            return
            except WATCH_ERRORS as exc:
                if self.stopping.is_set():
                    return
                log.debug("pod watch restarts: %s", describe(exc))
                self.stopping.wait(0.5)

    def _sync(self, pods: dict[str, JSON]) -> None:
        with self._lock:
            known = set(self._runners)
        for uid in known - set(pods):
            self._on_deleted({"metadata": {"uid": uid}})
        for pod in pods.values():
            self._on_pod(pod)

    def _on_pod(self, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            runner = self._runners.get(uid)
            if runner is None:
                if self.stopping.is_set():
                    return
                try:
                    ip = self._allocate_ip(pod)
                except RuntimeError as exc:
                    log.error("pod %s: %s", key(pod), exc)
                    return
                runner = PodRunner(self, pod, ip)
                self._runners[uid] = runner
                self._ips[uid] = ip
                runner.start()
                return
        runner.update(pod)

    def _on_deleted(self, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            runner = self._runners.get(uid)
            if runner is not None and runner.finished.is_set():
                del self._runners[uid]
                self._ips.pop(uid, None)
        if runner is not None:
            runner.gone()

    def runner_done(self, uid: str, runner: object, finished: bool) -> None:
        with self._lock:
            if finished and self._runners.get(uid) is runner:
                del self._runners[uid]
                self._ips.pop(uid, None)

    def _ip_candidates(self) -> Iterator[str]:
        lo, hi = self.config.ip_octets
        seed = f"{self.config.name}/{os.getpid()}".encode()
        start = int(hashlib.sha1(seed).hexdigest(), 16) % (hi - lo)
        while True:
            for i in range(hi - lo):
                x = lo + (start + i) % (hi - lo)
                for y in range(2, 255):
                    yield f"127.0.{x}.{y}"

    def _allocate_ip(self, pod: JSON) -> str:
        ports = sorted(
            {int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        )
        used = set(self._ips.values())
        # A pod's IPs are immutable once set: a node that comes back (a new ProcessNode under the
        # same name) runs an already-started pod on the address it had.
        recorded = (pod.get("status") or {}).get("podIP")
        if recorded and recorded not in used:
            return str(recorded)
        for _ in range(20000):
            ip = next(self._ip_iter)
            if ip in used:
                continue
            if all(_bindable(ip, port) for port in ports):
                return ip
        raise RuntimeError("no free loopback address for the pod")


def _bindable(ip: str, port: int) -> bool:
    assert ipaddress.ip_address(ip).is_loopback
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True
