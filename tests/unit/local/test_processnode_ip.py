"""A process node that comes back under the same name runs an already-started pod on the IP the
pod has: pod IPs are immutable, and a second IP makes every status update fail with 422."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from weightlift.local.processnode import ProcessNode


def _pod(ip: str | None) -> dict[str, Any]:
    return {"spec": {"containers": []}, "status": {"podIP": ip} if ip else {}}


def test_recorded_pod_ip_is_kept() -> None:
    node: Any = SimpleNamespace(_ips={}, _ip_iter=iter(["127.0.9.9"]))
    assert ProcessNode._allocate_ip(node, _pod("127.0.197.2")) == "127.0.197.2"


def test_new_pod_gets_a_fresh_ip() -> None:
    node: Any = SimpleNamespace(
        _ips={"other": "127.0.9.8"}, _ip_iter=iter(["127.0.9.8", "127.0.9.9"])
    )
    assert ProcessNode._allocate_ip(node, _pod(None)) == "127.0.9.9"
