"""The official kubernetes client as the local stack, the benchmarks and the tests use it.

`Kube(kubeconfig, agent)`: one ApiClient (a kubeconfig's current context) and the typed APIs on
it. `call(api.method, ...)` answers the wire JSON, a plain dict as the API server sent it
(camelCase), as operator/kube.py does: `_preload_content=False`, no model classes between the
API server and code that reads objects as a kubelet or kubectl would.

Every request has a deadline (TIMEOUT unless it names its own, as a watch does): urllib3 has
none, and a thread must not hang on an API server that went away (the chaos bench restarts it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from weightlift.operator.kube import api_error

JSON = dict[str, Any]
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
TIMEOUT = 30.0
# What a call raises: ApiException for an error status (a TLS failure is status 0), urllib3's
# errors when no answer comes (connection refused or reset, timed out).
KUBE_ERRORS: tuple[type[Exception], ...] = (ApiException, urllib3.exceptions.HTTPError)
# urllib3 keeps this many connections (the process node's threads, a bench's concurrent calls);
# beyond it each connection is dropped after use, and the next call pays a new TLS handshake.
POOL_SIZE = 32


class _DeadlineClient(client.ApiClient):
    """An ApiClient whose requests time out after TIMEOUT s unless they name a timeout."""

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("_request_timeout"):
            kwargs["_request_timeout"] = TIMEOUT
        return super().call_api(*args, **kwargs)


class Kube:
    """The API server of a kubeconfig's current context. `agent` names this client in the API
    server's audit log (weightlift-local/AGENT), apart from the operator's clients."""

    def __init__(self, kubeconfig: Path, agent: str) -> None:
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = POOL_SIZE
        self.api = _DeadlineClient(configuration)
        self.api.user_agent = f"weightlift-local/{agent}"
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    @property
    def server(self) -> str:
        """The API server's URL (https://host:port)."""
        return str(self.api.configuration.host)

    def close(self) -> None:
        self.api.close()


def call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> JSON:
    """`method(*args, **kwargs)`, a typed API's method, answered as the wire JSON dict. Bodies
    may be plain dicts (the client validates them against its models)."""
    response = method(*args, _preload_content=False, **kwargs)
    data = response.data
    doc: JSON = json.loads(data) if data else {}
    return doc


def get_or_none(method: Callable[..., Any], *args: Any, **kwargs: Any) -> JSON | None:
    """`call`, with None for 404 (no such object)."""
    try:
        return call(method, *args, **kwargs)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def delete(method: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`call` a delete method; 404 (already gone) is fine."""
    get_or_none(method, *args, **kwargs)


def describe(exc: BaseException) -> str:
    """An API error as one line: status, reason and the API server's own message (what
    ApiException's str buries under the HTTP headers); any other error as its str."""
    if not isinstance(exc, ApiException):
        return str(exc)
    return f"HTTP {api_error(exc)}"


def install_crds(kube: Kube, crds: Iterable[JSON], timeout: float = 60.0) -> list[str]:
    """Create (or replace) each CRD; wait until every one is Established. Their names."""
    ext = client.ApiextensionsV1Api(kube.api)
    names = []
    for crd in crds:
        name = crd["metadata"]["name"]
        try:
            call(ext.create_custom_resource_definition, crd)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = call(ext.read_custom_resource_definition, name)
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            call(ext.replace_custom_resource_definition, name, crd)
        names.append(name)
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            status = call(ext.read_custom_resource_definition, name).get("status") or {}
            conds = status.get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {name} not Established after {timeout:.0f}s")
            time.sleep(0.1)
    return names
