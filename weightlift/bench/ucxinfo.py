"""What UCX itself says it chose: with UCX_PROTO_INFO=y it prints, per endpoint, a table of the
protocols it picked ("remote memory read by ucp_get*" and the transport in its table). Read back
from a process's output by `bench p2p --node` and `bench gpu`. No Kubernetes here."""

from __future__ import annotations

import re

_READ_HEADER = "remote memory read by ucp_get"
# A table row of UCX's protocol info: "| 0..inf | zero-copy | cma/memory |".
_ROW = re.compile(r"\|\s*[0-9]+\.\.(?:inf|[0-9]+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


def read_transports(log: str) -> list[str]:
    """The transports UCX chose for remote reads (ucp_get) in a process's output, in order of
    first appearance, e.g. ["cma/memory"] or ["tcp/eth0"]. A multi-lane choice ("50% on
    tcp/eth0 and 50% on ...") is kept whole."""
    found: list[str] = []
    in_read = False
    for line in log.splitlines():
        if "|" not in line:
            continue
        if _READ_HEADER in line:
            in_read = True
            continue
        if in_read and (match := _ROW.search(line)):
            transport = match.group(2)
            if transport not in found:
                found.append(transport)
        elif in_read and "cfg#" in line:  # the next endpoint's table: reads only
            in_read = False
    return found
