"""A pod of a multi-pod replica computes with its group's other pods: torch.distributed, gloo.

Every pod of a group binds only its own ranks (api.worker.group_ranks). Once its weights are
bound it joins the group: rank = its LWS index, world = the group's size, rendezvous at the
hand-off's `leader` (host:port), where the leader (index 0) hosts the TCPStore. The leader binds
that store's socket to its own pod IP, not 0.0.0.0: on the local process node every pod shares
the host's network namespace (each with its own 127.x IP), so two groups' leaders would
otherwise collide on one port; a real pod has its own netns, where 0.0.0.0 does as well.

The group has one stream of collectives, driven by one thread per pod (`GroupRunner`): the
leader sends each inference (a header, then the input) and, while idle, a heartbeat every
HEARTBEAT_SECONDS; followers serve that stream. Each tp-blocks layer sums the pod's local
partials, then all-reduces them across the pods. A collective that raises or outlasts
COLLECTIVE_SECONDS means a rank is gone: the pod names it (the members it can no longer reach
at their front doors) and fails (GroupBroken, not permanent: the pod exits, its container
restarts and LeaderWorkerSet recreates the group).

Process groups are built directly (ProcessGroupGloo over our own store), not as torch's
process-global default group: nothing else in the worker uses torch.distributed, and a test may
run several groups' pods in one process.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import torch
import torch.distributed as dist

from weightlift.worker.engines.builtin.runtime import Pt2Runtime
from weightlift.worker.engines.vllm.store_bind import listening_socket
from weightlift.worker.plan import GroupPlace

log = logging.getLogger(__name__)

# The followers' wait for the leader's store and everyone's gloo connections (the pods of a
# group finish loading their shards at about the same time).
JOIN_SECONDS = 120.0
# One collective longer than this: a rank is gone (dead, hung or cut off).
COLLECTIVE_SECONDS = 10.0
# An idle leader's heartbeat: followers wait at most COLLECTIVE_SECONDS for the next command,
# and both sides notice a dead rank while no inference runs.
HEARTBEAT_SECONDS = 2.0
PROBE_SECONDS = 1.0
# The command header: [command, dtype, ndim, dims...], the leader's, summed with zeros.
HEADER_LEN = 16
BEAT, INFER = 1, 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class GroupBroken(RuntimeError):
    """A collective of the group failed: a rank is gone. Not permanent."""


class LeaderFailed(GroupBroken):
    """The group's leader failed for good (bad files, missing init symbol): so does this pod,
    without exiting. Exiting would restart it, LWS would recreate the group, and the leader
    would fail the same way: a crash loop of the whole group."""

    permanent = True


def leader_failure(leader: str, port: int) -> str | None:
    """The leader's message if its front door (its IP, the worker `port`) reports a permanent
    failure; None when it does not, or does not answer."""
    host, _ = split_address(leader)
    where = f"[{host}]" if ":" in host else host
    try:
        report = httpx.get(f"http://{where}:{port}/weightlift/v1/status", timeout=PROBE_SECONDS)
        doc = report.json()
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("phase") == "Failed" and doc.get("permanentFailure"):
        return str(doc.get("message") or "failed")
    return None


@dataclass(frozen=True)
class Member:
    index: int
    pod: str
    address: str  # host:port of the member's front door

    def name(self) -> str:
        return f"group rank {self.index} (pod {self.pod} at {self.address})"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GroupBroken(f"the group's leader {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _listening_socket(host: str, port: int) -> socket.socket:
    try:
        return listening_socket(host, port)
    except OSError as exc:
        raise GroupBroken(f"the group leader cannot listen on {host}:{port}: {exc}") from exc


class Group:
    """This pod's membership: a gloo process group over its group's pods."""

    def __init__(
        self,
        place: GroupPlace,
        store: dist.Store,
        pg: Any,  # a ProcessGroupGloo (a Backend; torch's stubs give it no collectives)
        members: list[Member],
        collective_seconds: float = COLLECTIVE_SECONDS,
    ) -> None:
        self.place = place
        self.store = store  # kept: the leader's store serves while the group lives
        self.pg = pg
        self.members = members
        self.timeout = datetime.timedelta(seconds=collective_seconds)

    @classmethod
    def join(
        cls,
        place: GroupPlace,
        leader: str,
        me: Member,
        join_seconds: float = JOIN_SECONDS,
        collective_seconds: float = COLLECTIVE_SECONDS,
    ) -> Group:
        """Rendezvous at `leader` (blocking, up to `join_seconds`); raises GroupBroken."""
        host, port = split_address(leader)
        wait = datetime.timedelta(seconds=join_seconds)
        try:
            if place.leader:
                sock = _listening_socket(place.pod_ip or "0.0.0.0", port)
                store: dist.Store = dist.TCPStore(
                    host,
                    port,
                    place.size,
                    True,
                    wait,
                    wait_for_workers=False,
                    master_listen_fd=sock.detach(),
                )
            else:
                store = dist.TCPStore(host, port, place.size, False, wait)
            store.set(f"member/{me.index}", json.dumps(asdict(me)))
            # _Options: the constructor's overload that takes devices (torch's stubs lack it).
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = wait
            device = (
                dist.ProcessGroupGloo.create_device(hostname=place.pod_ip)
                if place.pod_ip
                else dist.ProcessGroupGloo.create_default_device()
            )
            opts._devices = [device]
            pg = dist.ProcessGroupGloo(store, place.index, place.size, opts)
            members = [Member(**json.loads(store.get(f"member/{i}"))) for i in range(place.size)]
        except GroupBroken:
            raise
        except Exception as exc:  # torch raises RuntimeError/DistStoreError/TimeoutError
            raise GroupBroken(
                f"group rank {place.index} of {place.size} could not join its group at "
                f"{leader} within {join_seconds:.0f}s: {exc}"
            ) from exc
        log.info(
            "joined the group at %s as rank %d of %d: %s",
            leader,
            place.index,
            place.size,
            ", ".join(m.name() for m in members),
        )
        return cls(place, store, pg, members, collective_seconds)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self.broken(exc, what) from exc

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` (a CPU tensor) in place over the group."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # stubs: RedOpType, accepted
        opts.timeout = self.timeout
        self._wait(self.pg.allreduce([t], opts), "all-reduce")

    def broadcast(self, t: torch.Tensor) -> None:
        """The leader's `t` into every member's `t` (CPU tensors)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._wait(self.pg.broadcast([t], opts), "broadcast")

    def unreachable(self) -> list[Member]:
        """The other members whose front door does not answer (dead, hung, cut off)."""
        gone = []
        for m in self.members:
            if m.index == self.place.index:
                continue
            try:
                httpx.get(f"http://{m.address}/v2/health/live", timeout=PROBE_SECONDS)
            except httpx.HTTPError:
                gone.append(m)
        return gone

    def broken(self, exc: BaseException, what: str) -> GroupBroken:
        """GroupBroken naming the ranks that are gone (or, none unreachable, all the others)."""
        gone = self.unreachable()
        others = [m for m in self.members if m.index != self.place.index]
        who = "; ".join(m.name() for m in gone or others)
        verb = "is gone" if len(gone) == 1 else ("are gone" if gone else "did not answer")
        return GroupBroken(
            f"group broken: {who} {verb}; group rank {self.place.index}'s {what} failed: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        )


def _summed(group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(t: torch.Tensor) -> torch.Tensor:
        host = t.to("cpu", copy=True).contiguous()
        group.all_reduce(host)
        return host.to(t.device)

    return reduce


class GroupRunner:
    """The group's one stream of collectives, in one thread: the leader sends each inference
    (and heartbeats), followers serve them. `failed` completes (with GroupBroken) when the
    group breaks; then nothing more runs."""

    def __init__(self, group: Group, runtime: Pt2Runtime) -> None:
        self.group = group
        self.runtime = runtime
        self.failed: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._jobs: queue.Queue[
            tuple[list[torch.Tensor], concurrent.futures.Future[list[torch.Tensor]]]
        ] = queue.Queue()
        self._stop = threading.Event()
        main = self._lead if group.place.leader else self._follow
        self._thread = threading.Thread(
            target=self._run, args=(main,), daemon=True, name="wl-group"
        )

    def start(self) -> GroupRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def submit(self, args: list[torch.Tensor]) -> concurrent.futures.Future[list[torch.Tensor]]:
        """The leader: run one inference across the group (its outputs)."""
        fut: concurrent.futures.Future[list[torch.Tensor]] = concurrent.futures.Future()
        if self.failed.done():
            fut.set_exception(self.failed.exception() or GroupBroken("the group is broken"))
        else:
            self._jobs.put((args, fut))
        return fut

    def _run(self, main: Callable[[], None]) -> None:
        try:
            main()
        except Exception as exc:
            broken = exc if isinstance(exc, GroupBroken) else GroupBroken(f"group broken: {exc}")
            if not self._stop.is_set():
                log.error("%s", broken)
            self.failed.set_exception(broken)
            while not self._jobs.empty():  # nobody waits forever on a broken group
                _, fut = self._jobs.get_nowait()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(broken)
        else:
            self.failed.set_result(None)

    def _header(self, *values: int) -> torch.Tensor:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.group.all_reduce(header)  # everyone but the leader adds zeros: the leader's
        return header

    def _lead(self) -> None:
        while not self._stop.is_set():
            try:
                args, fut = self._jobs.get(timeout=HEARTBEAT_SECONDS)
            except queue.Empty:
                self._header(BEAT)
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._infer(args))
            except BaseException as exc:
                fut.set_exception(exc)
                raise

    def _infer(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        x = args[0]
        if x.dtype not in DTYPES or x.dim() > HEADER_LEN - 3:
            raise GroupBroken(f"a group cannot send a {x.dtype} input of {x.dim()} dims")
        self._header(INFER, DTYPES.index(x.dtype), x.dim(), *x.shape)
        sent = x.to("cpu", copy=True).contiguous()
        self.group.broadcast(sent)
        return self.runtime.forward([x], reduce=_summed(self.group))

    def _follow(self) -> None:
        while not self._stop.is_set():
            header = self._header()
            command = int(header[0])
            if command == BEAT:
                continue
            if command != INFER:
                raise GroupBroken(f"the group's leader sent an unknown command {command}")
            dtype, ndim = DTYPES[int(header[1])], int(header[2])
            x = torch.empty([int(d) for d in header[3 : 3 + ndim]], dtype=dtype)
            self.group.broadcast(x)
            self.runtime.forward([x.to(self.runtime.device)], reduce=_summed(self.group))
