"""Thin, typed wrappers over the kubernetes client returning plain dicts (the wire JSON).

`_preload_content=False` + json keeps objects exactly as the API server sent them (camelCase),
which is what planning, tests and kubectl users all read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from weightlift.api.labels import LWS_API_VERSION, LWS_GROUP, LWS_PLURAL
from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.api.times import now_rfc3339
from weightlift.operator import apicalls

Obj = dict[str, Any]
# Blocking API calls run in threads (asyncio.to_thread), one per call in flight. Python's default
# executor has cpu_count + 4 threads (6 on 2 cores): at 50-500 ms per call on a busy API server,
# 100 deployments' passes queued behind those 6 for 20 s. The pool keeps one connection a thread.
API_THREADS = 32
# Every call: the answer raw (see above), and a (connect, read) timeout in seconds. The client's
# default is no timeout at all: a half-open connection would hold an API thread, and the pass
# waiting on it, forever. 60 s is the API server's own --request-timeout, so a slow but live
# answer is never cut short; a timeout raises (urllib3) and the pass retries like any failed one.
_WIRE: dict[str, Any] = {"_preload_content": False, "_request_timeout": (10.0, 60.0)}


def load_config() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # The client reads $KUBECONFIG once, at import; read it now so that a KUBECONFIG set
        # in-process (cluster.py's documented use, tests, the demo) is the one used, as kopf does.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    configuration = client.Configuration.get_default_copy()
    # urllib3 drops connections beyond the pool size: each drop is a new TLS handshake.
    configuration.connection_pool_maxsize = API_THREADS
    api = client.ApiClient(configuration)
    apicalls.instrument_client(api)  # weightlift_api_requests_total, each attempt
    return api


def _json(response: Any) -> Any:
    return json.loads(response.data)


def _done(response: Any) -> None:
    """Read the unread body of a `_preload_content=False` response: only then does urllib3 put
    the connection back in the pool. Unread, each write closed its connection and the next one
    paid a new TLS handshake (a quarter of the operator's CPU at 1000 deployments, and the API
    server's)."""
    response.drain_conn()
    response.release_conn()


def patch_status(api: client.CustomObjectsApi, namespace: str, name: str, status: Obj) -> None:
    # The answer (the whole object) is not decoded: nothing reads it.
    _done(
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, **_WIRE
        )
    )


def list_deployments(
    api: client.CustomObjectsApi, namespace: str, field_selector: str
) -> list[Obj]:
    """Served from the API server's watch cache (resourceVersion 0: milliseconds behind etcd,
    unlike kopf's index). Without it each call was a quorum read of every ModelDeployment:
    at 1000 deployments these LISTs timed out (504) and starved the API server. The selector
    names the CRD's selectableFields (api.labels.SELECTABLE_FIELDS)."""
    body = _json(
        api.list_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=field_selector,
            resource_version="0",
            **_WIRE,
        )
    )
    items: list[Obj] = body.get("items", [])
    return items


def list_pods(core: client.CoreV1Api, namespace: str, selector: str) -> list[Obj]:
    body = _json(core.list_namespaced_pod(namespace, label_selector=selector, **_WIRE))
    items: list[Obj] = body.get("items", [])
    return items


def api_error(exc: ApiException) -> str:
    """The API server's own message (e.g. a missing ServiceAccount), without HTTP headers."""
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return f"{exc.status} {exc.reason}: {message or exc.body or ''}".strip()


def _create_if_absent(create: Any, namespace: str, manifest: Obj) -> bool:
    """Create; False when it already exists (a previous reconcile got there first). The client
    accepts plain dicts (sent as-is); its stubs only name the model classes."""
    try:
        _done(create(namespace, manifest, **_WIRE))
        return True
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise


def create_pod(core: client.CoreV1Api, namespace: str, manifest: Obj) -> bool:
    return _create_if_absent(core.create_namespaced_pod, namespace, manifest)


def delete_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    try:
        _done(core.delete_namespaced_pod(name, namespace, **_WIRE))
    except ApiException as exc:
        if exc.status != 404:
            raise


def patch_pod_metadata(core: client.CoreV1Api, namespace: str, name: str, metadata: Obj) -> None:
    """Merge `metadata` (labels, annotations) into the pod's."""
    # Without an explicit type the client picks application/json-patch+json for any body, which
    # the API server rejects for a dict; this is a merge patch.
    _done(
        core.patch_namespaced_pod(
            name,
            namespace,
            {"metadata": metadata},
            _content_type="application/merge-patch+json",
            **_WIRE,
        )
    )


def set_pod_condition(core: client.CoreV1Api, namespace: str, name: str, condition: Obj) -> None:
    """Set one condition of the pod's status (its readiness gate's): a strategic merge patch of
    pods/status merges conditions by type, leaving the kubelet's own untouched."""
    body = {"status": {"conditions": [condition]}}
    _done(
        core.patch_namespaced_pod_status(
            name,
            namespace,
            body,
            _content_type="application/strategic-merge-patch+json",
            **_WIRE,
        )
    )


# Server-side apply's field manager: the fields of the Service this operator owns.
FIELD_MANAGER = "weightlift-operator"


def apply_service(core: client.CoreV1Api, namespace: str, manifest: Obj) -> None:
    """Create or update the Service (server-side apply: one request either way; fields others
    set, such as a clusterIP or a LoadBalancer's annotations, stay theirs). Not forced: a
    Service of that name that someone else made with another selector is a conflict (409),
    never taken over."""
    _done(
        core.patch_namespaced_service(
            manifest["metadata"]["name"],
            namespace,
            manifest,
            field_manager=FIELD_MANAGER,
            _content_type="application/apply-patch+yaml",
            **_WIRE,
        )
    )


def delete_service(core: client.CoreV1Api, namespace: str, name: str) -> None:
    try:
        _done(core.delete_namespaced_service(name, namespace, **_WIRE))
    except ApiException as exc:
        if exc.status != 404:
            raise


def max_node_gpus(core: client.CoreV1Api, resource: str) -> int | None:
    """The most `resource` any node offers, or None when nodes cannot be listed."""
    try:
        body = _json(core.list_node(**_WIRE))
    except ApiException:
        return None
    best = 0
    for node in body.get("items", []):
        raw = node.get("status", {}).get("allocatable", {}).get(resource, "0")
        try:
            best = max(best, int(raw))
        except ValueError:
            continue
    # No GPU node at all (e.g. a pool scaled to zero) is unknown, not "too small".
    return best or None


def post_event(
    core: client.CoreV1Api, involved: Mapping[str, Any], event_type: str, reason: str, message: str
) -> None:
    """Events via the core API (kopf.event needs a running kopf context; this does not)."""
    meta = involved["metadata"]
    now = now_rfc3339()
    event: Obj = {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", f"{GROUP}/{VERSION}"),
            "kind": involved.get("kind", "ModelDeployment"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "weightlift-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    _done(core.create_namespaced_event(meta["namespace"], event, **_WIRE))  # type: ignore[arg-type]


def create_configmap(core: client.CoreV1Api, namespace: str, manifest: Obj) -> bool:
    return _create_if_absent(core.create_namespaced_config_map, namespace, manifest)


def delete_configmaps(core: client.CoreV1Api, namespace: str, selector: str) -> None:
    """One DELETE of every ConfigMap the label selector matches (deletecollection)."""
    _done(core.delete_collection_namespaced_config_map(namespace, label_selector=selector, **_WIRE))


def ensure_owned_secret(core: client.CoreV1Api, namespace: str, manifest: Obj) -> None:
    """Create the Secret, or add this manifest's owner to the one that exists (a strategic
    merge patch merges ownerReferences by uid: concurrent owners do not overwrite each other).
    Its data is never read or replaced."""
    name = manifest["metadata"]["name"]
    owners = {"metadata": {"ownerReferences": manifest["metadata"]["ownerReferences"]}}
    for _ in range(3):  # create / patch, racing the garbage collector deleting the last owner
        try:
            _done(core.create_namespaced_secret(namespace, manifest, **_WIRE))  # type: ignore[arg-type]
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        try:
            _done(
                core.patch_namespaced_secret(
                    name,
                    namespace,
                    owners,
                    _content_type="application/strategic-merge-patch+json",
                    **_WIRE,
                )
            )
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
    raise RuntimeError(f"secret {namespace}/{name} kept vanishing while being created")


# LeaderWorkerSets (multi-pod replicas, groups.py).
def create_lws(api: client.CustomObjectsApi, namespace: str, manifest: Obj) -> bool:
    def create(ns: str, body: Obj, **kwargs: Any) -> Any:
        return api.create_namespaced_custom_object(
            LWS_GROUP, LWS_API_VERSION, ns, LWS_PLURAL, body, **kwargs
        )

    return _create_if_absent(create, namespace, manifest)


def scale_lws(api: client.CustomObjectsApi, namespace: str, name: str, replicas: int) -> None:
    _done(
        api.patch_namespaced_custom_object(
            LWS_GROUP,
            LWS_API_VERSION,
            namespace,
            LWS_PLURAL,
            name,
            {"spec": {"replicas": replicas}},
            _content_type="application/merge-patch+json",
            **_WIRE,
        )
    )


def delete_lws(api: client.CustomObjectsApi, namespace: str, name: str) -> None:
    try:
        _done(
            api.delete_namespaced_custom_object(
                LWS_GROUP, LWS_API_VERSION, namespace, LWS_PLURAL, name, **_WIRE
            )
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


def delete_lws_sets(api: client.CustomObjectsApi, namespace: str, selector: str) -> None:
    """Every LeaderWorkerSet matching `selector` (a deleted ModelDeployment's); none when LWS is
    not installed."""
    try:
        _done(
            api.delete_collection_namespaced_custom_object(
                LWS_GROUP, LWS_API_VERSION, namespace, LWS_PLURAL, label_selector=selector, **_WIRE
            )
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
