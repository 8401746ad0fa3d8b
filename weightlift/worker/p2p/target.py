"""Target side: pull one rank's shard from one peer with one-sided NIXL READs, verified.

`pull_from_peer` fetches the peer's manifest, checks it against what the model needs, allocates
one contiguous local buffer, registers it, issues batched READs with several requests in flight,
checksums each tensor as soon as its bytes have landed, and returns tensors (views into the
buffer) only when every checksum matched. Any failure raises PeerFailed naming the peer, tensor
and reason; the caller moves on to the next candidate with a fresh buffer, so partial data is
never served.

Dead and slow peers are detected by: an ERR state from NIXL, a deadline per batch of READs
(transfer_timeout_seconds), a stall detector (no batch completed for stall_seconds while some are
in flight) and a liveness thread that polls the peer's /health every liveness_interval seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import torch

from weightlift.worker.p2p import P2P_PREFIX, faultgate, reserve
from weightlift.worker.p2p.expected import ExpectedTensor, ShapeMismatch, check_manifest
from weightlift.worker.p2p.manifest import RankManifest, checksum, element_size
from weightlift.worker.p2p.nixl_compat import new_agent, proto_dir
from weightlift.worker.p2p.transport import EmulationChoice, choose_on_emulation
from weightlift.worker.p2p.ucx_proto import read_transports, recorded
from weightlift.worker.peer_auth import auth_headers, peer_token
from weightlift.worker.weights.progress import LoadProgress
from weightlift.worker.weights.tensors import TORCH_DTYPES, canonical_residue, slot_bytes

log = logging.getLogger(__name__)

# PullResult.phases() (consecutive, they add up to the pull) and .overlapped() (beside them).
PULL_PHASES = ("manifest", "alloc", "agent", "transfer", "verify")
OVERLAPPED_PHASES = ("prefault", "memory_wait")
# Buffers whose READs could not be cancelled: kept alive so a late write lands in memory nobody
# uses, never in a reallocation.
_QUARANTINE: list[torch.Tensor] = []


class PeerFailed(Exception):
    """Pulling from one peer failed; the message names the peer and what went wrong."""

    def __init__(self, peer: str, message: str, *, kind: str = "transfer") -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer
        # manifest | mismatch | transfer | dead | stall | checksum | emulated
        self.kind = kind
        # What UCX used for the READs, when it was learnt before the failure.
        self.transport = ""


@dataclass
class PullOptions:
    transfer_timeout_s: float = 30.0
    max_in_flight: int = 8
    # A READ request moves at most batch_bytes; tensors larger than chunk_bytes are split.
    batch_bytes: int = 64 << 20
    chunk_bytes: int = 64 << 20
    # No batch completed for this long while some are in flight: the peer is stalled.
    stall_seconds: float = 5.0
    liveness_interval_s: float = 0.5
    liveness_failures: int = 2
    http_timeout_s: float = 3.0
    # Fault the local host buffer in with a memset in a thread, front to back, and post each
    # READ once the memory it lands in is faulted: page faults happen in a fast memset, not one
    # by one inside the transport, and they overlap the manifest, the agent set-up and the READs
    # of the part already faulted. Only matters for host memory.
    prefault: bool = True
    prefault_chunk_bytes: int = 16 << 20
    # Test/bench hook: pause this long after posting each batch (simulates a slow link).
    throttle_s: float = 0.0
    # Storage follows a failed pull: a pull of GPU memory that UCX can only emulate (tens of
    # times slower than storage) gives up for it as its first READ is posted
    # (choose_on_emulation).
    storage_fallback: bool = True


@dataclass
class PullResult:
    tensors: dict[str, torch.Tensor]
    manifest: RankManifest
    seconds: float
    transfer_seconds: float
    nbytes: int
    batches: int
    peer_pod: str
    timings: dict[str, float] = field(default_factory=dict)
    # The protocol UCX chose for the READs, in its own words (ucx_proto.py), e.g.
    # "cma/memory (zero-copy)", "cuda_ipc/cuda (zero-copy)", "tcp/lo (software emulation)".
    transport: str = ""
    # Why the pull went on over a software emulation (choose_on_emulation), else "".
    transport_note: str = ""

    def phases(self) -> dict[str, float]:
        """Seconds spent in each step, one after the other: manifest (fetch + check), alloc (the
        local buffer allocated; it is faulted in by a thread meanwhile), agent (NIXL agent,
        buffer registered, remote added, connected), transfer (session + READs, including any
        wait for memory not yet faulted: see `overlapped`), verify (checksums not yet done when
        the last READ landed)."""
        marks = ["manifest", "alloc", "agent", "transfer_done", "verified"]
        out: dict[str, float] = {}
        prev = 0.0
        for mark in marks:
            if mark in self.timings:
                out[mark.removesuffix("_done").replace("verified", "verify")] = round(
                    self.timings[mark] - prev, 4
                )
                prev = self.timings[mark]
        return out

    def overlapped(self) -> dict[str, float]:
        """Work that ran beside the steps above (not to be added to them): `prefault` (seconds
        the thread faulting the local buffer in took) and `memory_wait` (seconds the READs
        waited for it, inside `transfer`: the part of the faulting the pull could not hide)."""
        return {k: round(self.timings[k], 4) for k in OVERLAPPED_PHASES if k in self.timings}


@dataclass
class _Batch:
    index: int
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    nbytes: int
    # tensor index -> bytes of it in this batch
    parts: dict[int, int]
    # Bytes of the local buffer up to the end of this batch's last READ (the buffer is filled
    # front to back: a READ may be posted once the prefault has passed this offset).
    end: int = 0


def _layout_size(expected: dict[str, ExpectedTensor]) -> int | None:
    """Bytes of the local buffer for these tensors (the same in any order and whatever their
    residues: one slot each, see `_Pull.alloc`); None when a dtype is unknown (the manifest
    check will say so)."""
    total = 0
    for t in expected.values():
        numel = 1
        for d in t.shape:
            numel *= d
        try:
            total += slot_bytes(numel * element_size(t.dtype))
        except KeyError:
            return None
    return total


# Public: what a Target in standby reserves ahead of the pull (reserve.py).
layout_size = _layout_size


class _Prefault:
    """Faults a fresh host buffer in, front to back, in a thread (torch's zero_ drops the GIL).

    Fresh memory costs a page fault per 4 KiB on first touch (~1 GB/s a thread on a VM, the
    slowest part of a pull on one host). READs are posted only into the prefix already faulted
    (`wait_until`), so the faulting overlaps the manifest fetch, the agent set-up and the READs
    already posted; the memset never runs over bytes a READ has written.
    """

    def __init__(self, buf: torch.Tensor, chunk_bytes: int) -> None:
        self.buf = buf
        self.chunk = max(chunk_bytes, 4096)
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._faulted = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="p2p-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        n = self.buf.numel()
        offset = 0
        try:
            while offset < n and not self._stop:
                end = min(n, offset + self.chunk)
                self.buf[offset:end].zero_()
                offset = end
                with self._cond:
                    self._faulted = offset
                    self._cond.notify_all()
        except BaseException as exc:  # MemoryError and friends: the pull reports it
            self.error = exc
        finally:
            self.seconds = time.monotonic() - t0
            with self._cond:
                self._stop = True
                self._cond.notify_all()

    def wait_until(self, end: int, timeout: float) -> bool:
        """True once bytes [0, end) are faulted in (False on timeout, error or stop)."""
        with self._cond:
            self._cond.wait_for(lambda: self._faulted >= end or self._stop, timeout)
            return self._faulted >= end

    def ready(self, end: int) -> bool:
        return self._faulted >= end

    def close(self) -> None:
        """Stop and join: after this nothing but the READs writes into the buffer."""
        self._stop = True
        self._thread.join()


def _base_url(address: str) -> str:
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


_HTTP_LOCK = threading.Lock()
_HTTP: tuple[int, httpx.Client] | None = None


def peer_http() -> httpx.Client:
    """This process's one HTTP client for peers (thread-safe, one connection pool): plain http,
    no CA load; each request gives its own timeout and the peer token's headers. A client per
    pull cost 0.07-0.2 s inside a pull that runs beside the program opening's imports (2 cores,
    ~1 ms on an idle host); the first of a process also imports httpcore (~0.05 s idle), so
    prewarm_nixl makes this one early. One per pid: a forked child must not share its parent's
    connections."""
    global _HTTP
    with _HTTP_LOCK:
        if _HTTP is None or _HTTP[0] != os.getpid():
            _HTTP = (os.getpid(), httpx.Client(verify=False))
        return _HTTP[1]


def fetch_manifest(
    client: httpx.Client,
    address: str,
    *,
    identity: str,
    rank: int,
    peer: str,
    headers: dict[str, str] | None = None,
    timeout: float = PullOptions.http_timeout_s,
) -> RankManifest:
    url = f"{_base_url(address)}{P2P_PREFIX}/manifest"
    try:
        params: dict[str, str | int] = {"rank": rank, "identity": identity}
        resp = client.get(url, params=params, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PeerFailed(peer, f"manifest request to {url} failed: {exc!r}", kind="dead") from exc
    if resp.status_code != 200:
        try:
            message = resp.json().get("message", resp.text)
        except ValueError:
            message = resp.text[:200]
        kind = "mismatch" if resp.status_code in (404, 409) else "manifest"
        raise PeerFailed(peer, f"manifest refused ({resp.status_code}): {message}", kind=kind)
    try:
        return RankManifest.model_validate_json(resp.content)
    except ValueError as exc:
        raise PeerFailed(peer, f"manifest is invalid: {exc}", kind="manifest") from exc


class _Liveness:
    """Polls the peer's health endpoint in a thread; `dead` is set with a reason on failure."""

    def __init__(self, address: str, peer: str, opts: PullOptions, headers: dict[str, str]) -> None:
        self.url = f"{_base_url(address)}{P2P_PREFIX}/health"
        self.peer = peer
        self.opts = opts
        self.headers = headers
        self.dead = threading.Event()
        self.reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"p2p-live-{peer}", daemon=True)

    def __enter__(self) -> _Liveness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.opts.liveness_interval_s * 4 + 1)

    def _run(self) -> None:
        failures = 0
        timeout = max(self.opts.liveness_interval_s * 2, 0.5)
        client = peer_http()
        while not self._stop.wait(self.opts.liveness_interval_s):
            try:
                ok = client.get(self.url, headers=self.headers, timeout=timeout).status_code == 200
                why = "health answered non-200"
            except httpx.HTTPError as exc:
                ok, why = False, repr(exc)
            failures = 0 if ok else failures + 1
            if failures >= self.opts.liveness_failures:
                self.reason = f"liveness check failed {failures}x ({why})"
                self.dead.set()
                return


def forget_pull(exc: PeerFailed, device: torch.device) -> None:
    """Free a failed pull's buffer before the next candidate or the storage load allocates one.

    Whoever keeps the PeerFailed (to name every failed peer) keeps its traceback, whose frames
    keep the pull's locals and with them its buffer: a model-sized block held for nothing, on
    a GPU the one the next attempt needs. So the frames of the exception and of what caused it
    are cleared (the messages stay), and on CUDA the freed block goes back to the driver."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if cur.__traceback__ is not None:
            traceback.clear_frames(cur.__traceback__)
        cur = cur.__cause__ or cur.__context__
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _plan_batches(
    manifest: RankManifest,
    local_offsets: list[int],
    local_base: int,
    local_dev: int,
    opts: PullOptions,
) -> list[_Batch]:
    batches: list[_Batch] = []
    cur = _Batch(0, [], [], 0, {})
    for i, t in enumerate(manifest.tensors):
        region = manifest.regions[t.region]
        done = 0
        while done < t.nbytes:
            n = min(opts.chunk_bytes, t.nbytes - done, opts.batch_bytes - cur.nbytes)
            cur.local.append((local_base + local_offsets[i] + done, n, local_dev))
            cur.remote.append((region.addr + t.offset + done, n, region.device_id))
            cur.nbytes += n
            cur.parts[i] = cur.parts.get(i, 0) + n
            cur.end = max(cur.end, local_offsets[i] + done + n)
            done += n
            if cur.nbytes >= opts.batch_bytes:
                batches.append(cur)
                cur = _Batch(len(batches), [], [], 0, {})
    if cur.nbytes:
        batches.append(cur)
    return batches


def pull_from_peer(
    *,
    pod: str,
    address: str,
    identity: str,
    rank: int,
    reader: str,
    device: torch.device,
    expected: dict[str, ExpectedTensor] | None,
    opts: PullOptions,
    progress: LoadProgress | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    layout: str = "",
) -> PullResult:
    """Pull rank `rank` from the peer `pod` at `address`; raise PeerFailed on any failure.

    The steps, each timed (seconds since the start at which it ended): manifest, alloc (the
    buffer laid out and faulting in), agent (NIXL agent ready, remote added, connected),
    transfer_done, verified; then close, whatever happened."""
    pull = _Pull(pod, address, identity, rank, device, opts, progress)
    gate: faultgate.Claim | None = None
    transfer: _Transfer | None = None
    try:
        pull.reserve_early(expected)
        manifest = pull.fetch_manifest(expected, layout)
        gate = faultgate.claim(reader)  # the local chaos harness only (faultgate.py)
        if gate is not None:
            n = gate.read_bytes(manifest.total_bytes)
            pull.opts = replace(opts, batch_bytes=n, chunk_bytes=n, max_in_flight=1)
        pull.start_agent(reader)
        pull.alloc(manifest)
        pull.connect(manifest)
        pull.open_session(reader)
        transfer = _Transfer(pull, manifest, on_batch, gate)
        transfer.run()
        transfer.verify()
        pull.verified = True
        pull.timings["verified"] = time.monotonic() - pull.t0
        return PullResult(
            tensors={t.name: transfer.views[i] for i, t in enumerate(manifest.tensors)},
            manifest=manifest,
            seconds=time.monotonic() - pull.t0,
            transfer_seconds=transfer.seconds,
            nbytes=manifest.total_bytes,
            batches=len(transfer.batches),
            peer_pod=pod,
            timings=pull.timings,
            transport=pull.transport,
            transport_note=pull.transport_note,
        )
    except PeerFailed as exc:
        exc.transport = pull.transport
        raise
    finally:
        if gate is not None:
            gate.close()
        pull.close()
        if not pull.verified:  # nothing of this pull's may keep its buffer (forget_pull)
            if transfer is not None:
                transfer.views.clear()
            pull.release()


class _Pull:
    """One pull's resources and the steps that acquire them; `close` releases what was made."""

    def __init__(
        self,
        pod: str,
        address: str,
        identity: str,
        rank: int,
        device: torch.device,
        opts: PullOptions,
        progress: LoadProgress | None,
    ) -> None:
        self.pod, self.address, self.identity, self.rank = pod, address, identity, rank
        self.device, self.opts, self.progress = device, opts, progress
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.client = peer_http()
        self.headers = auth_headers(peer_token())  # the peer token, if this pod has one
        self.session: str | None = None
        self.verified = False
        self.agent: Any = None
        self.agent_future: Future[Any] | None = None
        self.remote_name: str | None = None
        self.reg: Any = None
        self.handles: list[Any] = []
        self.buf: torch.Tensor | None = None
        self.prefault: _Prefault | None = None
        self.early_size: int | None = None
        self.offsets: list[int] = []
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.local_dev = (device.index or 0) if device.type == "cuda" else 0
        self.transport = ""
        self.transport_note = ""
        self.recorded_before: set[str] = set()
        self.quarantined = False

    def _new_buffer(self, size: int) -> None:
        if self.prefault is not None:
            self.prefault.close()
            self.prefault = None
        self.buf = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        if self.opts.prefault and self.device.type == "cpu":
            self.prefault = _Prefault(self.buf, self.opts.prefault_chunk_bytes)

    def reserve_early(self, expected: dict[str, ExpectedTensor] | None) -> None:
        """With the model's own headers the buffer size is known before the manifest arrives:
        take the one faulted in while this Target waited in standby (reserve.py), or allocate
        it and start faulting it in now (see _Prefault)."""
        self.early_size = _layout_size(expected) if expected is not None else None
        if self.early_size is None:
            return
        self.buf = reserve.take(self.device, self.early_size)
        if self.buf is None:
            self._new_buffer(self.early_size)

    def fetch_manifest(
        self, expected: dict[str, ExpectedTensor] | None, layout: str = ""
    ) -> RankManifest:
        manifest = fetch_manifest(
            self.client,
            self.address,
            identity=self.identity,
            rank=self.rank,
            peer=self.pod,
            headers=self.headers,
            timeout=self.opts.http_timeout_s,
        )
        try:
            check_manifest(
                manifest,
                identity=self.identity,
                rank=self.rank,
                expected=expected,
                peer=self.pod,
                layout=layout,
            )
        except ShapeMismatch as exc:
            message = str(exc).removeprefix(f"peer {self.pod}: ")
            raise PeerFailed(self.pod, message, kind="mismatch") from exc
        if self.progress is not None:
            self.progress.set_total(manifest.total_bytes)
        self.timings["manifest"] = time.monotonic() - self.t0
        return manifest

    def start_agent(self, reader: str) -> None:
        """The agent: a spare one made by prewarm_nixl, else a new one (UCX context and worker:
        ~10 ms; the first in a process loads NIXL and UCX too, see prewarm_nixl), made in a
        thread while this one lays out the buffer. Started after the manifest fetch so it cannot
        starve that request."""
        setup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-agent")
        self.agent_future = setup.submit(_take_agent, _agent_name(f"{reader}-r{self.rank}"))
        setup.shutdown(wait=False)

    def alloc(self, manifest: RankManifest) -> None:
        """Local layout: one buffer, one slot per tensor in manifest order, each tensor at its
        source's address modulo 64 (the source follows the canonical placement of
        weights/tensors.py, so this replica computes bit for bit what the source does)."""
        total = 0
        for t in manifest.tensors:
            at = manifest.regions[t.region].addr + t.offset if t.nbytes else 0
            self.offsets.append(total + canonical_residue(self.device, at, element_size(t.dtype)))
            total += slot_bytes(t.nbytes)
        if self.buf is None or self.early_size != total:
            self._new_buffer(total)
        self.timings["alloc"] = time.monotonic() - self.t0

    def connect(self, manifest: RankManifest) -> None:
        """Register the buffer (while the prefault runs: one region, so every READ of this pull
        shares one registration; with RDMA NICs registering pins the pages), add the peer's
        agent and connect."""
        assert self.agent_future is not None and self.buf is not None
        agent = self.agent = self.agent_future.result()
        region = [(self.buf.data_ptr(), self.buf.numel(), self.local_dev, "")]
        self.reg = agent.register_memory(region, self.mem_type)
        directory = proto_dir(agent)
        self.recorded_before = recorded(directory) if directory is not None else set()
        try:
            remote_name = agent.add_remote_agent(manifest.metadata_bytes())
        except Exception as exc:
            raise PeerFailed(self.pod, f"cannot add NIXL agent {manifest.agent}: {exc}") from exc
        if isinstance(remote_name, bytes):
            remote_name = remote_name.decode()
        self.remote_name = remote_name
        try:
            agent.make_connection(remote_name)
        except Exception as exc:
            raise PeerFailed(
                self.pod, f"cannot connect to NIXL agent {remote_name}: {exc}"
            ) from exc
        self.timings["agent"] = time.monotonic() - self.t0

    def open_session(self, reader: str) -> None:
        try:
            r = self.client.post(
                f"{_base_url(self.address)}{P2P_PREFIX}/sessions",
                json={"identity": self.identity, "rank": self.rank, "reader": reader},
                headers=self.headers,
                timeout=self.opts.http_timeout_s,
            )
            if r.status_code == 201:
                self.session = r.json()["session"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise PeerFailed(self.pod, f"cannot open a session: {exc!r}", kind="dead") from exc

    def close(self) -> None:
        if self.prefault is not None:
            self.prefault.close()  # before the buffer is quarantined or freed
        if self.agent is None and self.agent_future is not None:
            with contextlib.suppress(Exception):
                self.agent = self.agent_future.result(timeout=30)
        clean = _cleanup(self.agent, self.handles, self.remote_name, self.reg, self.pod)
        if not clean and self.buf is not None:
            _QUARANTINE.append(self.buf)
            self.quarantined = True
        if clean and self.verified and self.agent is not None:
            _give_back(self.agent)  # all its state released: the next pull may use it
        if self.session is not None:
            with contextlib.suppress(httpx.HTTPError):
                self.client.request(
                    "DELETE",
                    f"{_base_url(self.address)}{P2P_PREFIX}/sessions/{self.session}",
                    # The rank routes the close where a source has one process per rank (vLLM).
                    json={"verified": self.verified, "rank": self.rank},
                    headers=self.headers,
                    timeout=1.0,
                )

    def release(self) -> None:
        """A failed pull lets go of its buffer (after close: its READs released, its memory
        deregistered, so only a quarantined READ could still write into it)."""
        self.buf = None
        self.prefault = None

    def learn_transport(self, manifest: RankManifest, nbytes: int) -> None:
        """What UCX recorded for this pull's READs (ucx_proto.py), once the first was posted:
        files new since this pull registered its buffer, else (UCX chose for an earlier pull of
        this agent and keeps its choice) every file of this agent's."""
        directory = proto_dir(self.agent)
        if directory is None:
            self.transport = "unknown (not recorded)"
            return
        fresh = recorded(directory) - self.recorded_before
        found = read_transports(
            directory,
            local_mem=self.mem_type,
            remote_mem=manifest.mem_type,
            nbytes=nbytes,
            names=fresh or None,
        )
        self.transport = "; ".join(str(t) for t in found) or "unknown (UCX recorded none)"
        choice = choose_on_emulation(
            found,
            local_mem=self.mem_type,
            remote_mem=manifest.mem_type,
            storage_fallback=self.opts.storage_fallback,
        )
        if choice is None:
            return
        log.warning("peer %s: %s", self.pod, choice.reason)
        self.transport_note = choice.reason
        if choice.action == EmulationChoice.STORAGE:
            raise PeerFailed(self.pod, choice.reason, kind="emulated")


class _Transfer:
    """The READs of one pull: batches posted as their memory is faulted, up to max_in_flight,
    each tensor checksummed as soon as its bytes have landed."""

    def __init__(
        self,
        pull: _Pull,
        manifest: RankManifest,
        on_batch: Callable[[int, int], None] | None,
        gate: faultgate.Claim | None = None,
    ) -> None:
        assert pull.buf is not None
        self.pull, self.manifest, self.on_batch, self.gate = pull, manifest, on_batch, gate
        self.pod = pull.pod
        buf = pull.buf
        self.batches = _plan_batches(
            manifest, pull.offsets, buf.data_ptr(), pull.local_dev, pull.opts
        )
        self.remaining = [t.nbytes for t in manifest.tensors]
        self.views: list[torch.Tensor] = []
        for i, t in enumerate(manifest.tensors):
            dtype = TORCH_DTYPES[t.dtype]
            if t.nbytes == 0:
                self.views.append(torch.empty(t.shape, dtype=dtype, device=pull.device))
            else:
                raw = buf[pull.offsets[i] : pull.offsets[i] + t.nbytes]
                self.views.append(raw.view(dtype).reshape(t.shape))
        self.kind = manifest.checksum_kind
        self.hashes: dict[int, Future[str]] = {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="p2p-verify")
        for i, t in enumerate(manifest.tensors):
            if t.nbytes == 0:
                self.hashes[i] = self.pool.submit(checksum, self.views[i], self.kind)
        self.pending = deque(self.batches)
        self.inflight: list[tuple[Any, _Batch, float]] = []
        self.done = 0
        self.seconds = 0.0
        self.last_progress = time.monotonic()
        self.memory_wait = 0.0

    def run(self) -> None:
        pull, opts = self.pull, self.pull.opts
        started = time.monotonic()
        try:
            with _Liveness(pull.address, self.pod, opts, pull.headers) as live:
                while self.pending or self.inflight:
                    self._wait_for_memory()
                    try:
                        self._post()
                        now = time.monotonic()
                        self.inflight = self._poll(now)
                    except PeerFailed:
                        raise
                    except Exception as exc:  # nixlRemoteDisconnectError and friends
                        message = f"NIXL {type(exc).__name__}: {exc} after {self._progress()}"
                        raise PeerFailed(self.pod, message, kind="dead") from exc
                    if self.inflight and now - self.last_progress > opts.stall_seconds:
                        message = (
                            f"no READ completed for {opts.stall_seconds:.1f}s "
                            f"({self._progress()} done)"
                        )
                        raise PeerFailed(self.pod, message, kind="stall")
                    if live.dead.is_set():
                        message = f"{live.reason} after {self._progress()}"
                        raise PeerFailed(self.pod, message, kind="dead")
                    if self.inflight:
                        time.sleep(0.0005)
        except BaseException:
            self.pool.shutdown(wait=True, cancel_futures=True)
            raise
        self.seconds = time.monotonic() - started
        pull.timings["transfer_done"] = time.monotonic() - pull.t0
        pull.timings["memory_wait"] = self.memory_wait
        if pull.prefault is not None:
            pull.prefault.close()
            pull.timings["prefault"] = pull.prefault.seconds

    def _progress(self) -> str:
        return f"{self.done}/{len(self.batches)} batches"

    def _wait_for_memory(self) -> None:
        """Nothing in flight: block until the next READ's memory is faulted."""
        prefault = self.pull.prefault
        if not self.pending or self.inflight or prefault is None:
            return
        waited = time.monotonic()
        prefault.wait_until(self.pending[0].end, timeout=0.05)
        self.memory_wait += time.monotonic() - waited
        self.last_progress = time.monotonic()  # a stall is READs in flight not moving
        if prefault.error is not None:
            raise PeerFailed(self.pod, f"cannot fault in the local buffer: {prefault.error!r}")

    def _post(self) -> None:
        pull, opts = self.pull, self.pull.opts
        agent, prefault = pull.agent, pull.prefault
        while (
            self.pending
            and len(self.inflight) < opts.max_in_flight
            and (prefault is None or prefault.ready(self.pending[0].end))
        ):
            b = self.pending.popleft()
            local = agent.get_xfer_descs(b.local, pull.mem_type)
            remote = agent.get_xfer_descs(b.remote, self.manifest.mem_type)
            h = agent.initialize_xfer("READ", local, remote, pull.remote_name)
            pull.handles.append(h)
            if agent.transfer(h) == "ERR":
                raise PeerFailed(self.pod, f"batch {b.index}: READ could not be posted")
            self.inflight.append((h, b, time.monotonic()))
            if b.index == 0:
                # UCX chose (and recorded) the READ's protocol as it was posted: a READ of GPU
                # memory it can only emulate is given up now, with one READ in flight.
                pull.learn_transport(self.manifest, max(n for _, n, _ in b.local))
            if opts.throttle_s:
                time.sleep(opts.throttle_s)

    def _poll(self, now: float) -> list[tuple[Any, _Batch, float]]:
        """The READs still in flight; finished ones counted and their tensors checksummed."""
        pull, agent = self.pull, self.pull.agent
        still: list[tuple[Any, _Batch, float]] = []
        for h, b, posted in self.inflight:
            state = agent.check_xfer_state(h)
            if state == "DONE":
                agent.release_xfer_handle(h)
                pull.handles.remove(h)
                self._landed(b, now)
            elif state == "ERR":
                raise PeerFailed(self.pod, f"batch {b.index}: READ failed (NIXL ERR)")
            elif now - posted > pull.opts.transfer_timeout_s:
                raise PeerFailed(
                    self.pod,
                    f"batch {b.index}: READ not done after "
                    f"{pull.opts.transfer_timeout_s:.1f}s (deadline)",
                    kind="stall",
                )
            else:
                still.append((h, b, posted))
        return still

    def _landed(self, b: _Batch, now: float) -> None:
        self.done += 1
        self.last_progress = now
        if self.pull.progress is not None:
            self.pull.progress.add(b.nbytes)
        for i, n in b.parts.items():
            self.remaining[i] -= n
            if self.remaining[i] == 0:
                self.hashes[i] = self.pool.submit(checksum, self.views[i], self.kind)
        if self.on_batch is not None:
            self.on_batch(self.done, len(self.batches))
        if self.gate is not None and not self.gate.held and self.pending:
            self._hold(self.gate)

    def _hold(self, gate: faultgate.Claim) -> None:
        """Hold with READs still to go and none in flight (a gated pull has one at a time) while
        the harness strikes; the peer's liveness is still checked meanwhile."""
        left = sum(b.nbytes for b in self.pending)
        gate.hold(
            faultgate.Held(
                pod=gate.pod,
                peer=self.pod,
                address=self.pull.address,
                rank=self.pull.rank,
                pid=os.getpid(),
                done=self.done,
                batches=len(self.batches),
                bytes_done=self.manifest.total_bytes - left,
                bytes_total=self.manifest.total_bytes,
            )
        )
        self.last_progress = time.monotonic()  # the hold is no stall of the peer's

    def verify(self) -> None:
        """Every tensor's checksum against the manifest's, or PeerFailed naming the tensor."""
        try:
            for i, t in enumerate(self.manifest.tensors):
                got = self.hashes[i].result()
                if got != t.checksum:
                    raise PeerFailed(
                        self.pod,
                        f"tensor {t.name!r}: {self.kind} checksum {got} != manifest {t.checksum}",
                        kind="checksum",
                    )
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


# Agents made ahead of time (prewarm_nixl) or handed back clean after a pull. A pull takes one
# instead of creating its own (~10 ms each once NIXL is loaded, more for the first in a
# process: prewarm_nixl), and hands it back instead of destroying it (~4 ms) inside the timed
# load.
_SPARE_AGENTS: list[Any] = []
_SPARE_LOCK = threading.Lock()
_MAX_SPARES = 8
_PREWARM_THREAD: threading.Thread | None = None


def prewarm_nixl(agents: int = 2) -> threading.Thread:
    """Load NIXL and its UCX plugin and make `agents` spare agents in a background thread (the
    first agent of a process loads NIXL's libraries, ~0.07 s with torch loaded, and UCX's: ~0.4 s
    more where UCX installs its memory hooks, i.e. on hosts with RDMA devices (transport.py);
    later ones ~10 ms). A target worker calls this as early as it knows it will pull (e.g. while
    its init hooks run); each rank's pull then takes a ready agent. Two by default: one per rank
    of a 2-rank pod; a pull that finds none makes its own."""
    global _PREWARM_THREAD

    def run() -> None:
        peer_http()  # built here, not in the manifest fetch (see peer_http)
        for _ in range(max(agents, 1)):
            try:
                agent = _new_agent(_agent_name("spare"))
            except Exception as exc:  # the pull will raise a clear error itself
                log.debug("prewarming NIXL failed: %s", exc)
                return
            _give_back(agent)

    thread = threading.Thread(target=run, name="p2p-prewarm", daemon=True)
    _PREWARM_THREAD = thread
    thread.start()
    return thread


def _agent_name(who: str) -> str:
    return f"wl-tgt-{who}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _take_agent(name: str) -> Any:
    """A spare agent if there is one (waiting for a prewarm under way), else a new one."""
    prewarm = _PREWARM_THREAD
    while True:
        with _SPARE_LOCK:
            if _SPARE_AGENTS:
                return _SPARE_AGENTS.pop()
        if prewarm is None or not prewarm.is_alive():
            return _new_agent(name)
        prewarm.join(timeout=0.005)


def _give_back(agent: Any) -> None:
    with _SPARE_LOCK:
        if len(_SPARE_AGENTS) < _MAX_SPARES:
            _SPARE_AGENTS.append(agent)
            return
    del agent


@atexit.register
def _drop_spare_agents() -> None:
    # A NIXL agent still alive when C++ static destructors run aborts the process.
    with _SPARE_LOCK:
        _SPARE_AGENTS.clear()


def _new_agent(name: str) -> Any:
    # Our polling loop (check_xfer_state) drives the agent; UCX records its READ protocols so
    # the pull can say which transport moved the bytes.
    return new_agent(name, record_reads=True)


def _cleanup(agent: Any, handles: list[Any], remote_name: str | None, reg: Any, pod: str) -> bool:
    """Release NIXL state; False when a READ could not be cancelled (its buffer must live on)."""
    clean = True
    if agent is None:
        return clean
    stuck = _release(agent, handles, pod)
    if remote_name is not None:
        try:
            agent.remove_remote_agent(remote_name)
        except Exception as exc:
            clean = False  # the buffer needs no quarantine, but the agent is not reused
            log.debug("peer %s: remove_remote_agent failed: %s", pod, exc)
    if stuck:
        # The peer's endpoint is closed now: UCX has completed what was pending on it (with
        # an error), so a READ that refused to cancel before may be released.
        stuck = _release(agent, stuck, pod)
    if reg is not None:
        try:
            agent.deregister_memory(reg)
        except Exception as exc:
            clean = False
            log.debug("peer %s: deregister failed: %s", pod, exc)
    return clean and not stuck


def _release(agent: Any, handles: list[Any], pod: str) -> list[Any]:
    """Release each READ handle; the ones that refused (a READ to a dead peer may)."""
    stuck = []
    for h in handles:
        try:
            agent.release_xfer_handle(h)
        except Exception as exc:
            stuck.append(h)
            log.debug("peer %s: releasing a READ handle failed: %s", pod, exc)
    return stuck
