"""Ports for local servers: one place that asks the kernel for free ones."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now (all held open together, so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now."""
    return free_ports(1, host)[0]
