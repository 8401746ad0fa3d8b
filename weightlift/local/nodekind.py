"""The one interface the local stack holds its node by, whichever kind runs the pods:

- "process" (processnode/): pods run as host processes on 127.0.x.y; fast, many pods, no
  isolation (the default: demo, chaos, scale-out, the operator bench);
- "kubelet" (kubeletnode/): pods run as containers under the pinned kubelet with containerd,
  runc and a CNI bridge, from images pulled from the stack's registry: namespaces, read-only
  root filesystems, uid 1000, memory limits and the kubelet's own downwardAPI refresh are real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

NODE_KINDS = ("process", "kubelet")
NodeKindName = Literal["process", "kubelet"]


class NodeKind(Protocol):
    """What LocalStack, the demo, the tests and the benches need of a node."""

    @property
    def name(self) -> str: ...

    def start(self) -> None:
        """Register the Node and return once it runs pods."""

    def stop(self, timeout: float = 30.0) -> None:
        """Every pod and process gone, the Node deleted; safe after a failed start."""

    def pids(self) -> dict[str, list[int]]:
        """namespace/name -> host pids of each running pod's containers."""

    def pod_logs(self, namespace: str, pod: str) -> list[Path]:
        """The log files of a pod's containers on this node (newest run last)."""

    @property
    def fault_gate_dir(self) -> Path:
        """Where tests and the chaos harness hold this node's workers at a known step
        (worker/p2p/faultgate.py): every worker pod sees it, and only on a local node."""
