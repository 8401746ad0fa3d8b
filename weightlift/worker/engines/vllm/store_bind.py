"""The group leader's torch.distributed TCPStore listens on its pod IP only, not every address.

vLLM's ranks meet over `tcp://<master-addr>:<master-port>` (engines/vllm/group.py), and torch's
store server binds that port on every address. On the local process node all pods share the
host's network namespace (each with its own 127.x IP): two groups' leaders would collide on the
one port the hand-off names. So, as the builtin group does (engines/builtin/group.py), the
leader's rank 0 binds the socket to its own IP and hands it to the store. A real pod has its own
netns, where this changes nothing. Applied by the plugin in every vLLM process the worker starts
when the worker sets STORE_HOST_ENV (the leader pod of a group).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

# The leader pod's IP: the store of rank 0 is bound to it (set only in a group leader's vLLM).
STORE_HOST_ENV = "WEIGHTLIFT_VLLM_STORE_HOST"

log = logging.getLogger(__name__)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` only (IPv4 or v6), SO_REUSEADDR set: a group leader's
    store (here and engines/builtin/group.py). OSError when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def bind_store_to_pod_ip() -> None:
    """Wrap torch's `_create_c10d_store` so rank 0's server, when hosted at STORE_HOST_ENV,
    listens there only; idempotent, and nothing at all without the variable."""
    host = os.environ.get(STORE_HOST_ENV)
    if not host:
        return
    from torch.distributed import TCPStore

    # The module: `torch.distributed.rendezvous` is also a function of that package.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    original: Any = rendezvous._create_c10d_store
    if getattr(original, "weightlift_bound", False):
        return

    def create(
        hostname: str, port: int, rank: int, world_size: int, timeout: Any, use_libuv: bool = True
    ) -> Any:
        if rank != 0 or hostname.strip("[]") != host or rendezvous._torchelastic_use_agent_store():
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        sock = listening_socket(host, port)
        log.info("weightlift: the group's TCPStore listens on %s:%d only", host, port)
        return TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            use_libuv=use_libuv,
        )

    create.weightlift_bound = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create  # type: ignore[attr-defined]
