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
So the one thing worth doing about UCX_TLS is saying when an inherited one makes same-host
pulls slow or impossible.

GPU memory is another matter (notes/gpu-h200.md, one H200, nixl-cu13's UCX): UCX's cuda_ipc turns
GET (our READ) off where it sees no NVLink (`CUDA_IPC_ENABLE_GET_ZCOPY=auto`), and a READ of VRAM
then runs as "software emulation" over tcp/lo at 0.4-0.5 GB/s; with GET zero-copy on it is
zero-copy cuda_ipc (2 GB in 9 ms), with NIXL's `peer` error handling kept (cuda_ipc supports it).
So every agent we make asks for it (`AGENT_UCX_OPTIONS`), through NIXL's UCX `engine_config`:
options of that agent's UCX context, not process-wide variables.

What the first agent of a process costs is another matter: ~0.45 s here, of which ~0.4 s is
UCM (UCX's memory hooks) patching mmap, munmap, mremap, shmat, shmdt, brk, sbrk and madvise in
place ("bistro" mode): each patch parks the function on a jump-to-self and then spins on
sched_yield for a fixed grace time (UCX 1.23: 50 ms each, 8 patches, seen with strace) so no
thread is inside the old code. The hooks feed memory-unmapped events to registration caches,
which only devices that register memory need (RDMA NICs; cma and tcp register nothing). On a
host without RDMA devices `ucx_defaults` adds UCX_MEM_MMAP_HOOK_MODE=none: UCM then reports
those events unsupported (it fires test events and checks), UCX runs without a registration
cache, and the first UCX backend takes ~0.013 s instead of ~0.45 s (same host, same wheel).
Hosts with RDMA devices keep UCX's defaults; a UCX_MEM_MMAP_HOOK_MODE the user set always wins.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightlift.worker.p2p.ucx_proto import ReadTransport

# UCX_TLS names that include cma (aliases expand: "sm"/"shm" cover cma, posix, sysv).
_WITH_CMA = {"all", "cma", "sm", "shm"}
# Transports that carry NIXL's active messages with peer-failure handling.
_RDMA = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib"}
_RDMA |= {"ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"}
_WITH_AM = {"all", "tcp"} | _RDMA
# RDMA devices (InfiniBand, RoCE, EFA, iWARP) as the kernel lists them; libibverbs, and so UCX,
# finds them here too.
RDMA_SYSFS = (Path("/sys/class/infiniband"), Path("/sys/class/infiniband_verbs"))
# What a host without RDMA devices does not need from UCX (see the module docstring).
NO_RDMA_DEFAULTS = {"UCX_MEM_MMAP_HOOK_MODE": "none"}
# Options of each agent's UCX context (names without UCX_; a UCX_<name> set in the environment
# wins: NIXL only fills in what the environment leaves unset).
AGENT_UCX_OPTIONS = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
# NIXL's default, said out loud: a dead peer fails our READs instead of hanging them.
ERROR_HANDLING = "peer"


def engine_config(options: Mapping[str, str]) -> str:
    """NIXL's UCX `engine_config`: `NAME=value` pairs joined by commas (the plugin splits on
    ',' and the first '='), so neither may appear where it would split wrongly."""
    pairs = []
    for name, value in options.items():
        if not name or "," in name or "=" in name or "," in value:
            raise ValueError(f"UCX option {name}={value!r}: no ',' in either, no '=' in the name")
        pairs.append(f"{name.removeprefix('UCX_')}={value}")
    return ",".join(pairs)


def ucx_backend_params(options: Mapping[str, str]) -> dict[str, str]:
    """The init parameters of NIXL's UCX backend for one agent."""
    return {"ucx_error_handling_mode": ERROR_HANDLING, "engine_config": engine_config(options)}


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


def rdma_devices(sysfs: tuple[Path, ...] = RDMA_SYSFS) -> list[str]:
    """The host's RDMA devices (empty when there are none or the kernel has no RDMA support)."""
    found: set[str] = set()
    for path in sysfs:
        try:
            found.update(p.name for p in path.iterdir())
        except OSError:
            continue
    return sorted(found)


def ucx_defaults(env: Mapping[str, str], rdma: list[str]) -> dict[str, str]:
    """UCX settings to add to `env` before UCX loads: none with RDMA devices, never a key the
    user set."""
    if rdma:
        return {}
    return {k: v for k, v in NO_RDMA_DEFAULTS.items() if k not in env}


def apply_ucx_defaults(env: MutableMapping[str, str]) -> dict[str, str]:
    """Add `ucx_defaults` to `env` (os.environ: read by UCX when NIXL first loads it, and
    inherited by child processes); returns what was added."""
    added = ucx_defaults(env, rdma_devices())
    env.update(added)
    return added


class EmulationChoice(StrEnum):
    STORAGE = "storage"  # give the peer up: the storage load that follows is faster
    CONTINUE = "continue"  # pull on, slowly: nothing else may load these weights


@dataclass(frozen=True)
class Emulated:
    action: EmulationChoice
    reason: str


def choose_on_emulation(
    transports: Sequence[ReadTransport],
    *,
    local_mem: str,
    remote_mem: str,
    storage_fallback: bool,
) -> Emulated | None:
    """What a pull does when UCX moves GPU memory by software emulation; None when it does not.

    Emulation of host memory (tcp between hosts without RDMA) is how host memory moves there,
    and as fast as that network; emulation of GPU memory measured 0.4-0.75 GB/s on an H200
    (notes/gpu-h200.md), 30-60x slower than loading from the page cache and slower than a cold
    read, so storage wins whenever the plan allows it. Staging through pinned host memory would
    not help: the peer's side of the READ is its GPU memory, which UCX would emulate the same
    way. `local_mem`/`remote_mem`: NIXL's DRAM or VRAM."""
    if "VRAM" not in (local_mem, remote_mem):
        return None
    emulated = [t for t in transports if t.emulated]
    if not emulated:
        return None
    said = "; ".join(str(t) for t in emulated)
    what = f"UCX moves GPU memory ({remote_mem} to {local_mem}) only by {said}"
    if storage_fallback:
        return Emulated(EmulationChoice.STORAGE, f"{what}: loading from storage instead (faster)")
    return Emulated(EmulationChoice.CONTINUE, f"{what}: pulling anyway (no storage fallback)")
