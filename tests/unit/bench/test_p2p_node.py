"""Which UCX transport a pull took, read from UCX's own protocol report (UCX_PROTO_INFO=y)."""

from __future__ import annotations

from weightlift.bench.ucxinfo import read_transports

# Two endpoints of a worker's output on the process node (UCX 1.23, nixl 1.5), a put table
# between them that must not count, and a log line of ours.
LOG = """\
[1795680366.34] [vm:2:2]   +--------+-------------+-------------------------------------------+
[1795680366.34] [vm:2:2]   | wl-tgt-spare-25711-2ae81ff2 intra-node cfg#1                     |
[1795680366.34] [vm:2:2]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795680366.34] [vm:2:2]   +--------+-------------+-------------------------------------------+
[1795680366.34] [vm:2:2]   | Range  | Description |                  Config                   |
[1795680366.34] [vm:2:2]   +--------+-------------+-------------------------------------------+
[1795680366.34] [vm:2:2]   | 0..inf | zero-copy   | cma/memory                                |
[1795680366.34] [vm:2:2]   +--------+-------------+-------------------------------------------+
[1795680366.35] [vm:25711:2]   | wl-tgt inter-node cfg#2                                          |
[1795680366.35] [vm:25711:2]   | remote memory write by ucp_put*(multi) from host memory to host  |
[1795680366.35] [vm:25711:2]   | 0..inf | zero-copy   | posix/memory                              |
2026-11-26 08:06:06,504 INFO weightlift.worker.loaders.p2p: rank 1: 8158208 bytes from peer
[1795680367.1] [vm:25711:2]   | wl-tgt inter-node cfg#3                                          |
[1795680367.1] [vm:25711:2]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795680367.1] [vm:25711:2]   | 0..8191 | copy-in  | tcp/eth0                                  |
[1795680367.1] [vm:25711:2]   | 8192..inf | zero-copy | tcp/eth0                                |
"""


def test_reads_only_in_order_without_repeats() -> None:
    assert read_transports(LOG) == ["cma/memory", "tcp/eth0"]


def test_no_protocol_report_no_transport() -> None:
    assert read_transports("INFO weightlift: nothing from UCX here\n") == []
