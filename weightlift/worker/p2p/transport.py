"""Which UCX transports a pull uses, and a warning when UCX_TLS rules out the fast ones.

We set no UCX_TLS: UCX's own choice is the fastest correct one everywhere we measured. On one
host (bench/p2p.py, nixl-cu12's UCX 1.23) it moves READs with cma (process_vm_readv: zero-copy,
one copy in the kernel) and its active messages and wire-up over tcp/lo; on a cluster it picks
RDMA (rc/dc/ud) or cuda_ipc when they exist, which a fixed list would rule out. What we saw with
UCX_TLS forced, same run, same host:
  - "tcp": every byte through loopback sockets, READs 3-10x slower;
  - "shm,tcp", "cma,tcp", "tcp,cma": the same transports as unset (cma + tcp/lo);
  - "sm", "shm", "cma", "posix"/"sysv" alone: NIXL's agent cannot be made ("no active messages
    transport ... posix/memory - no peer failure handler, cma/memory - no am bcopy"): NIXL asks
    for peer-failure error handling, which the shared-memory transports lack.
So the one thing worth doing is saying when an inherited UCX_TLS makes same-host pulls slow or
impossible.
"""

from __future__ import annotations

from collections.abc import Mapping

# UCX_TLS names that include cma (aliases expand: "sm"/"shm" cover cma, posix, sysv).
_WITH_CMA = {"all", "cma", "sm", "shm"}
# Transports that carry NIXL's active messages with peer-failure handling.
_RDMA = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib"}
_RDMA |= {"ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"}
_WITH_AM = {"all", "tcp"} | _RDMA


def transport_warning(env: Mapping[str, str]) -> str | None:
    """Why UCX_TLS in `env` would make P2P pulls slow or fail, or None when it is fine."""
    value = env.get("UCX_TLS", "").strip()
    if not value:
        return None
    excluded = value.startswith("^")
    names = {n.strip().lower() for n in value.removeprefix("^").split(",") if n.strip()}
    if excluded:
        if "cma" in names or names & {"sm", "shm"}:
            return (
                f"UCX_TLS={value} excludes cma: READs between processes on one host go "
                "through TCP loopback (3-10x slower); unset UCX_TLS to let UCX choose"
            )
        return None
    if not names & _WITH_AM:
        return (
            f"UCX_TLS={value} has no transport NIXL can send its control messages on (it needs "
            "peer-failure handling: tcp or an RDMA transport); NIXL agents will fail to start"
        )
    if not names & (_WITH_CMA | _RDMA):
        return (
            f"UCX_TLS={value} leaves out cma: READs between processes on one host go through "
            "TCP loopback (3-10x slower); add cma or unset UCX_TLS"
        )
    return None
