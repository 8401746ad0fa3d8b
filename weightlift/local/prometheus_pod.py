"""Prometheus as a pod of the real node, as users run it: where pods live in network namespaces
of their own, a scraper on the host is not where a cluster's is, so on the kubelet node the
stack's Prometheus is a pod in namespace `monitoring`, under the ServiceAccount `prometheus`,
finding its targets through in-cluster Kubernetes service discovery (the API server through the
`kubernetes` Service) and scraping them over the pod network.

Its image is the pinned, statically linked binary (hack/build-prometheus.sh) alone in an image
made from scratch with buildah, as the pause image is, pushed to the stack's registry. The
host queries it at its pod IP, through the node's bridge route.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from weightlift.local.kube import JSON, Kube, call, delete

CONFIG_MAP = "prometheus-config"
POD = "prometheus"
PORT = 9090
UID = 65534  # nobody: the image holds one static binary and writes only its emptyDir
_SUM_LABEL = "dev.weightlift.binary-sha256"


class PodPrometheusError(RuntimeError):
    """The image could not be made or the pod did not come up."""


def image_name(version: str) -> str:
    return f"localhost/weightlift/prometheus:{version}"


def _buildah(*args: str) -> str:
    exe = shutil.which("buildah")
    if exe is None:
        raise PodPrometheusError("buildah is not installed: run `make node` (it installs it)")
    done = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PodPrometheusError(f"buildah {args[0]}: {done.stderr.strip()}")
    return done.stdout.strip()


def ensure_image(binary: Path, version: str) -> str:
    """The image of `binary`, built unless buildah holds one of the same binary (by sha256)."""
    image = image_name(version)
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    try:
        held = _buildah("inspect", "--type", "image", "--format", "{{.OCIv1.Config.Labels}}", image)
    except PodPrometheusError:
        held = ""
    if digest in held:
        return image
    work = _buildah("from", "scratch")
    try:
        _buildah("copy", "--chmod", "0555", work, str(binary), "/bin/prometheus")
        _buildah(
            "config",
            "--entrypoint", '["/bin/prometheus"]',
            "--user", f"{UID}:{UID}",
            "--label", f"{_SUM_LABEL}={digest}",
            work,
        )  # fmt: skip
        _buildah("commit", "--rm", work, image)
    except PodPrometheusError:
        subprocess.run(["buildah", "rm", work], capture_output=True, check=False)
        raise
    return image


def manifests(namespace: str, account: str, image_ref: str, config: JSON) -> tuple[JSON, JSON]:
    """The ConfigMap with prometheus.yml and the pod: non-root, read-only root filesystem, no
    capabilities, its TSDB in an emptyDir; ready when Prometheus says so."""
    configmap = {
        "metadata": {"name": CONFIG_MAP, "namespace": namespace},
        "data": {"prometheus.yml": yaml.safe_dump(config, sort_keys=False)},
    }
    pod = {
        "metadata": {"name": POD, "namespace": namespace, "labels": {"app": POD}},
        "spec": {
            "serviceAccountName": account,
            "automountServiceAccountToken": True,  # in-cluster service discovery
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": UID,
                "fsGroup": UID,
            },
            "containers": [
                {
                    "name": POD,
                    "image": image_ref,
                    "args": [
                        "--config.file=/etc/prometheus/prometheus.yml",
                        "--storage.tsdb.path=/prometheus",
                        f"--web.listen-address=:{PORT}",
                        "--storage.tsdb.retention.time=1d",
                    ],
                    "ports": [{"name": "web", "containerPort": PORT}],
                    "readinessProbe": {
                        "httpGet": {"path": "/-/ready", "port": PORT},
                        "periodSeconds": 1,
                    },
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                                  "limits": {"memory": "512Mi"}},
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
                        {"name": "data", "mountPath": "/prometheus"},
                    ],
                }
            ],
            "volumes": [
                {"name": "config", "configMap": {"name": CONFIG_MAP}},
                {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}},
            ],
        },
    }  # fmt: skip
    return configmap, pod


def start(kube: Kube, namespace: str, configmap: JSON, pod: JSON, timeout: float) -> str:
    """Create both, wait for the pod to be Ready; its IP. A pod that does not get there is
    reported with its status (the kubelet's reason: an image pull, a crash)."""
    call(kube.core.create_namespaced_config_map, namespace, configmap)
    call(kube.core.create_namespaced_pod, namespace, pod)
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = call(kube.core.read_namespaced_pod, POD, namespace).get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP"):
            return str(status["podIP"])
        time.sleep(0.5)
    raise PodPrometheusError(f"prometheus pod not Ready after {timeout:.0f}s: {status}")


def stop(kube: Kube, namespace: str) -> None:
    delete(kube.core.delete_namespaced_pod, POD, namespace, grace_period_seconds=0)
    delete(kube.core.delete_namespaced_config_map, CONFIG_MAP, namespace)
