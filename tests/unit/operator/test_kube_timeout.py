"""Every API call of the operator gives up on a server that never answers: without a timeout the
kubernetes client waits forever, holding an API thread and the reconcile pass behind it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from weightlift.operator import kube


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never sends a byte: a half-open API server."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def _outcome(call: Callable[[], Any], within: float) -> BaseException | None:
    """What `call` raised, failing the test (not hanging it) if it is still waiting `within` s."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"still waiting on a silent API server after {within} s"
    return raised[0] if raised else None


def test_calls_time_out_on_a_silent_api_server(
    silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(kube._WIRE, "_request_timeout", (1.0, 0.3))
    api = client.ApiClient(client.Configuration(host=silent_server))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    calls: dict[str, Callable[[], Any]] = {
        "patch_status": lambda: kube.patch_status(custom, "ns", "md", {"phase": "Ready"}),
        "list_pods": lambda: kube.list_pods(core, "ns", "a=b"),  # a GET: urllib3 retries it
        "create_pod": lambda: kube.create_pod(core, "ns", {"metadata": {"name": "p"}}),
    }
    for what, call in calls.items():
        exc = _outcome(call, within=10.0)
        assert isinstance(exc, urllib3.exceptions.HTTPError), f"{what}: {exc!r}"
        assert "timed out" in str(exc), f"{what}: {exc!r}"
