"""Peer-to-peer weight transfer over NIXL.

A **source** (a worker that already holds a rank's weights) registers them with one NIXL agent
per rank and publishes a manifest over the worker's HTTP port; a **target** fetches the manifest
of its own rank, checks it against what the model needs, issues one-sided READs into
pre-allocated local buffers and verifies every checksum before the weights are served.

Modules: `nixl_compat` (import of the NIXL wheel; `new_agent`, the one place agents are made),
`manifest` (the wire format and checksums), `devsum` (dev64, the checksum computed on the
device holding the bytes; `devsum_triton` its CUDA kernel), `expected` (what a rank needs, from
the safetensors headers), `source` (SourcePublisher), `target` (pulling one rank from one
peer), `rendezvous` (which candidate first), `transport` (UCX options per agent, warnings and
defaults, and what a pull does when UCX only emulates GPU memory), `ucx_proto` (the transport
UCX recorded for our READs), `faultgate` (a hold the local stack's harness puts on one pull or
start, honoured only on a local node). The safetensors format and the load vocabulary come from
the floor below (`worker/weights/`); strategies (`worker/loaders/`) sit above.
"""

from __future__ import annotations

P2P_PREFIX = "/weightlift/v1/p2p"

__all__ = ["P2P_PREFIX"]
