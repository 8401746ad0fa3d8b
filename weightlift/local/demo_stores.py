"""Where the local stack keeps the demo model: a hostPath directory, a PVC bound to a hostPath PV,
or a MinIO bucket on loopback (`weightlift demo --storage hostpath|pvc|s3`, and the e2e tests).

Each returns the `spec.model` fields that point a ModelDeployment at it, and a closer that
removes what it made (the PV/PVC/Secret objects, the MinIO process)."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from weightlift.local.kube import JSON, Kube, call, delete

STORAGE_KINDS = ("hostpath", "pvc", "s3")
BUCKET = "models"


def _noop() -> None:
    return None


@dataclass
class DemoStorage:
    kind: str
    model: JSON  # spec.model fields: uri (+ endpoint, credentials)
    close: Callable[[], None] = field(default=_noop)
    secret_values: list[str] = field(default_factory=list)  # what must never show up anywhere


def _create_or_replace(kube: Kube, kind: str, obj: JSON) -> None:
    """Create a core/v1 object, or replace the one that exists. `kind`: the suffix of the
    core API's methods for it (persistent_volume, namespaced_secret, ...)."""
    namespaced = kind.startswith("namespaced_")
    where = {"namespace": obj["metadata"]["namespace"]} if namespaced else {}
    try:
        call(getattr(kube.core, f"create_{kind}"), body=obj, **where)
    except ApiException as exc:
        if exc.status != 409:
            raise
        name = obj["metadata"]["name"]
        current = call(getattr(kube.core, f"read_{kind}"), name=name, **where)
        obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        call(getattr(kube.core, f"replace_{kind}"), name=name, body=obj, **where)


def _delete(method: Callable[..., Any], *args: str) -> None:
    with contextlib.suppress(Exception):  # best effort: the cluster may be going away too
        delete(method, *args)


def pvc_storage(kube: Kube, namespace: str, name: str, model_dir: Path) -> DemoStorage:
    """A hostPath PV over the model's parent directory and a PVC bound to it by volumeName (the
    real PV controller binds them; the scheduler waits for that); uri pvc://<claim>/<dir>."""
    model_dir = model_dir.resolve()
    pv_name, claim = f"{namespace}-{name}-model", f"{name}-model"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(model_dir.parent), "type": "Directory"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv_name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    _create_or_replace(kube, "persistent_volume", pv)
    _create_or_replace(kube, "namespaced_persistent_volume_claim", pvc)

    def close() -> None:
        _delete(kube.core.delete_namespaced_persistent_volume_claim, claim, namespace)
        _delete(kube.core.delete_persistent_volume, pv_name)

    return DemoStorage("pvc", {"uri": f"pvc://{claim}/{model_dir.name}"}, close)


def s3_storage(
    kube: Kube, namespace: str, name: str, model_dir: Path, state_dir: Path
) -> DemoStorage:
    """MinIO on loopback, the model uploaded to s3://models/<name>, the credentials in a Secret."""
    from weightlift.local.s3server import MinioServer

    server = MinioServer(state_dir / "minio")
    server.start()
    try:
        server.upload_dir(model_dir, BUCKET, name)
        secret = f"{name}-s3-credentials"
        data = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
        _create_or_replace(
            kube,
            "namespaced_secret",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": secret, "namespace": namespace},
                "type": "Opaque",
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
            },
        )
    except BaseException:
        server.stop()
        raise

    def close() -> None:
        _delete(kube.core.delete_namespaced_secret, secret, namespace)
        server.stop()

    model = {
        "uri": f"s3://{BUCKET}/{name}",
        "endpoint": server.endpoint,
        "credentials": {"name": secret},
    }
    return DemoStorage("s3", model, close, secret_values=[server.secret_key])


def prepare_storage(
    kind: str, kube: Kube, namespace: str, name: str, model_dir: Path, state_dir: Path
) -> DemoStorage:
    if kind == "hostpath":
        return DemoStorage("hostpath", {"uri": f"hostpath://{model_dir.resolve()}"})
    if kind == "pvc":
        return pvc_storage(kube, namespace, name, model_dir)
    if kind == "s3":
        return s3_storage(kube, namespace, name, model_dir, state_dir)
    raise ValueError(f"storage {kind!r}: use one of {', '.join(STORAGE_KINDS)}")
