"""vLLM across the pods of a multi-pod replica (a LeaderWorkerSet group): one vLLM "node" per pod.

vLLM's multiprocessing executor spans nodes itself (docs/vllm-multinode-cpu.md): every pod runs
`vllm serve` with `--nnodes <pods> --node-rank <index> --master-addr <leader> --master-port
<port>` and the `mp` executor; the leader (index 0) runs the OpenAI server and hosts
torch.distributed's TCPStore (gloo on CPU), the others run `--headless`: only their ranks' worker
processes, which read the leader's scheduler output over ZMQ on `VLLM_HOST_IP`. Each pod's ranks
run the weightlift load format as in one pod: pod i of a target group pulls its ranks from pod i
of a source group. The leader's address is the hand-off's (groups.py: its pod IP and
GROUP_PORT), so vLLM starts only once the pod is handed its role: nothing of vLLM's can be built
before the group's ranks meet anyway (its distributed init comes before the model).

Free of torch and vLLM: the worker's front process imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightlift.worker.engines.vllm.store_bind import STORE_HOST_ENV
from weightlift.worker.plan import GroupPlace

# The executor that spans nodes (`uni`, the one-pod tests' choice, cannot).
EXECUTOR_FLAG = "--distributed-executor-backend"
# vLLM's env a pod of a group must set its own way: its address (ZMQ binds and advertises it),
# and the CPU cores its one local rank's threads are bound to.
HOST_IP_ENV = "VLLM_HOST_IP"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# The engine core runs in its own process, as in the multi-node run that was tried; the one-pod
# tests' "0" (engine core in the API server's process) was never tried across nodes.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class GroupAddressError(ValueError):
    permanent = True


def split_leader(leader: str) -> tuple[str, int]:
    """The hand-off's `leader` (host:port, [v6]:port) as vLLM's master address and port."""
    host, sep, port = leader.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GroupAddressError(f"the group's leader {leader!r} is not host:port")
    return host.strip("[]"), int(port)


def without_executor(args: Sequence[str]) -> list[str]:
    """The user's engine args less any executor choice (`--x y` or `--x=y`): a group's is mp."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == EXECUTOR_FLAG:
            skip = True
            continue
        if arg.startswith(EXECUTOR_FLAG + "="):
            continue
        out.append(arg)
    return out


def group_args(place: GroupPlace, leader: str, host: str, port: int) -> list[str]:
    """vLLM's arguments that make this pod node `place.index` of `place.size`: the leader serves
    the OpenAI API on host:port, the others are headless."""
    master, master_port = split_leader(leader)
    args = [
        EXECUTOR_FLAG,
        "mp",
        "--nnodes",
        str(place.size),
        "--node-rank",
        str(place.index),
        "--master-addr",
        master,
        "--master-port",
        str(master_port),
    ]
    if place.leader:
        return [*args, "--host", host, "--port", str(port)]
    return [*args, "--headless"]


def group_env(
    env: Mapping[str, str], place: GroupPlace, ranks: Sequence[int], tensor_parallel: int
) -> dict[str, str]:
    """The pod's vLLM env: its IP for ZMQ (and, the leader, for the group's store),
    multiprocessing on, and a thread binding of one
    entry per local rank. A binding that lists every rank of the replica (`0|1` for TP 2, as
    one pod would take it) is narrowed to this pod's ranks' entries."""
    out = dict(env)
    if place.pod_ip:
        out[HOST_IP_ENV] = place.pod_ip
        if place.leader:
            out[STORE_HOST_ENV] = place.pod_ip  # its rank 0's store: this IP only
    out.pop(MULTIPROCESSING_ENV, None)
    entries = out.get(THREADS_BIND_ENV, "").split("|")
    if len(entries) == tensor_parallel > len(ranks):
        out[THREADS_BIND_ENV] = "|".join(entries[r] for r in ranks)
    return out
