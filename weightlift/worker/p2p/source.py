"""Source side: register a rank's loaded tensors with NIXL and serve its manifest over HTTP.

The worker's aiohttp app forwards every request under /weightlift/v1/p2p/ to
`SourcePublisher.handle`. Routes (all JSON):

  GET    health                          liveness for targets waiting on a READ
  GET    manifest?rank=R&identity=ID     the rank's manifest (409 other identity, 404 unknown rank)
  POST   sessions  {identity, rank, reader}  a reader announces itself; returns a lease
  DELETE sessions/{id}  {verified, bytes}    the reader is done (or gives up)

The transfer itself is a one-sided READ issued by the target: the source keeps no per-reader NIXL
state, so a reader that vanishes mid-transfer cannot wedge the source for the next one (the
ModelExpress #555 failure mode, where later readers stalled for 300 s). Sessions are leases for
accounting (active readers, completed reads) and expire on their own.
"""

from __future__ import annotations

import atexit
import base64
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from aiohttp import web

from weightlift.worker.p2p import P2P_PREFIX
from weightlift.worker.p2p.manifest import (
    RankManifest,
    Region,
    TensorEntry,
    checksum,
    resolve_kind,
)
from weightlift.worker.p2p.nixl_compat import new_agent
from weightlift.worker.peer_auth import peer_token, refusal
from weightlift.worker.weights.tensors import canonical_residue, dtype_name, pack

if TYPE_CHECKING:
    from weightlift.api.model import ChecksumSetting
    from weightlift.api.worker import WorkerPlan

log = logging.getLogger(__name__)

# More distinct storages than this and we pack the rank into one buffer instead.
MAX_REGIONS = 16
SESSION_LEASE_SECONDS = 600.0
# Progress polling of each rank's agent: while a reader has a session open / when idle.
POLL_ACTIVE_S = 0.001
POLL_IDLE_S = 0.005


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@dataclass
class Session:
    id: str
    reader: str
    rank: int
    started: float = field(default_factory=time.monotonic)


class RankSource:
    """One rank's shard: its NIXL agent, registered regions and manifest."""

    def __init__(
        self,
        *,
        pod: str,
        identity: str,
        rank: int,
        tensors: dict[str, torch.Tensor],
        checksum_setting: ChecksumSetting,
        pool: ThreadPoolExecutor,
        busy: Callable[[], bool] = lambda: True,
        layout: str = "",
    ) -> None:
        if not tensors:
            raise ValueError(f"rank {rank}: no tensors to publish")
        self.rank = rank
        self._keep: list[torch.Tensor] = []  # whatever backs the registered regions
        regions, placed = self._regions(tensors)
        # name -> the tensor as it lives in registered memory
        self.placed: dict[str, torch.Tensor] = {name: t for name, (_, _, t) in placed.items()}
        device = next(iter(tensors.values())).device
        self.mem_type: Literal["DRAM", "VRAM"] = "VRAM" if device.type == "cuda" else "DRAM"
        # The plan's setting, `auto` resolved by where the weights are (dev64 on the device).
        checksum_kind = resolve_kind(checksum_setting, device)

        digests = dict(
            zip(
                placed,
                pool.map(lambda name: checksum(placed[name][2], checksum_kind), placed),
                strict=True,
            )
        )
        entries = [
            TensorEntry(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                nbytes=t.numel() * t.element_size(),
                region=region,
                offset=offset,
                checksum=digests[name],
            )
            for name, (region, offset, t) in placed.items()
        ]

        self.agent_name = f"wl-src-{pod}-r{rank}-{uuid.uuid4().hex[:8]}"
        # No NIXL progress thread (new_agent): it spins a core per agent even when idle
        # (measured ~30% of a core each here). Our own poller below progresses the agent, fast
        # while readers are active and slowly when idle.
        self.agent: Any = new_agent(self.agent_name)
        self._reg = self.agent.register_memory(
            [(r.addr, r.nbytes, r.device_id, "") for r in regions], self.mem_type
        )
        metadata = self.agent.get_agent_metadata()
        self.manifest = RankManifest(
            identity=identity,
            rank=rank,
            pod=pod,
            agent=self.agent_name,
            agent_metadata=base64.b64encode(metadata).decode(),
            mem_type=self.mem_type,
            checksum_kind=checksum_kind,
            layout=layout,
            total_bytes=sum(e.nbytes for e in entries),
            regions=regions,
            tensors=entries,
        )
        # Serialized once: every target's request gets these bytes (checksums were computed
        # above, at publish time, never per request).
        exclude = {"layout"} if not layout else set()
        self.manifest_body = self.manifest.model_dump_json(exclude=exclude).encode()
        self._busy = busy
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=self._progress, name=f"p2p-progress-r{rank}", daemon=True
        )
        self._poller.start()

    def _progress(self) -> None:
        """Drive the UCX worker: a one-sided READ still needs the source side progressed (the
        connection wire-up; without it the reader's first READ never completes)."""
        while not self._stop.wait(POLL_ACTIVE_S if self._busy() else POLL_IDLE_S):
            try:
                self.agent.get_new_notifs()
            except Exception as exc:  # a reader vanished mid-wireup: log, keep serving
                log.debug("rank %d: progress: %s", self.rank, exc)

    def _regions(
        self, tensors: dict[str, torch.Tensor]
    ) -> tuple[list[Region], dict[str, tuple[int, int, torch.Tensor]]]:
        """Few large regions: the tensors' own storages when there are few (a preload buffer),
        else one packed buffer. Returns regions and name -> (region, offset, tensor)."""
        devices = {t.device for t in tensors.values()}
        storages: dict[int, tuple[int, int]] = {}  # storage ptr -> (index, nbytes)
        if len(devices) == 1 and all(t.is_contiguous() for t in tensors.values()):
            for t in tensors.values():
                s = t.untyped_storage()
                if s.data_ptr() not in storages and s.nbytes() > 0:
                    storages[s.data_ptr()] = (len(storages), s.nbytes())
        if len(devices) == 1 and 0 < len(storages) <= MAX_REGIONS:
            device = next(iter(devices))
            dev_id = max(device.index or 0, 0) if device.type == "cuda" else 0
            regions = [Region(addr=p, nbytes=n, device_id=dev_id) for p, (_, n) in storages.items()]
            placed: dict[str, tuple[int, int, torch.Tensor]] = {}
            for name, t in tensors.items():
                s = t.untyped_storage()
                if s.nbytes() == 0:  # empty tensor: place it at offset 0 of region 0
                    placed[name] = (0, 0, t)
                    continue
                idx, _ = storages[s.data_ptr()]
                placed[name] = (idx, t.data_ptr() - s.data_ptr(), t)
            self._keep.extend(tensors.values())
            return regions, placed
        # Pack: one contiguous buffer on the first tensor's device, each tensor at the residue
        # mod 64 it has here (targets copy the placement from the manifest's addresses).
        device = next(iter(tensors.values())).device
        residues = {
            k: canonical_residue(device, t.data_ptr(), t.element_size()) for k, t in tensors.items()
        }
        packed = pack(tensors, device, residues)
        storage = next(iter(packed.values())).untyped_storage()
        base = storage.data_ptr()
        placed = {name: (0, view.data_ptr() - base, view) for name, view in packed.items()}
        self._keep.extend(packed.values())
        dev_id = max(device.index or 0, 0) if device.type == "cuda" else 0
        return [Region(addr=base, nbytes=storage.nbytes(), device_id=dev_id)], placed

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:
            log.warning("rank %d: deregister failed: %s", self.rank, exc)
        self.agent = None
        self._keep.clear()


# Publishers not closed by their owner are closed before the interpreter exits: a NIXL agent
# still alive when C++ static destructors run aborts the process ("terminate called without an
# active exception"), e.g. when a stop races the publisher's construction.
_LIVE_PUBLISHERS: weakref.WeakSet[SourcePublisher] = weakref.WeakSet()


@atexit.register
def _close_live_publishers() -> None:
    for publisher in list(_LIVE_PUBLISHERS):
        try:
            publisher.close()
        except Exception as exc:  # exiting anyway; say what could not be closed
            log.warning("closing a P2P publisher at exit: %s", exc)


class SourcePublisher:
    """Publishes every rank this worker holds; one NIXL agent per rank.

    Construct it off the event loop for large models (it checksums every tensor).
    """

    def __init__(
        self,
        plan: WorkerPlan,
        tensors_by_rank: dict[int, dict[str, torch.Tensor]],
        layout: str = "",
    ) -> None:
        """`layout`: who laid the tensors out (RankManifest.layout); empty for a checkpoint's."""
        self.identity = plan.model_identity
        self.pod = plan.pod_name
        setting = plan.loading.peer_to_peer.checksum
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self.completed_reads = 0
        self.failed_reads = 0
        self.expired_sessions = 0
        self._closed = False
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="p2p-hash") as pool:
            self.ranks = {
                rank: RankSource(
                    pod=self.pod,
                    identity=self.identity,
                    rank=rank,
                    tensors=tensors,
                    checksum_setting=setting,
                    pool=pool,
                    busy=lambda: bool(self._sessions),
                    layout=layout,
                )
                for rank, tensors in sorted(tensors_by_rank.items())
            }
        _LIVE_PUBLISHERS.add(self)

    # ------------------------------------------------------------------------------ http
    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._closed:
            return _error(503, "closed", f"{self.pod} is no longer a source")
        tail = request.path.removeprefix(P2P_PREFIX).strip("/")
        self._sweep()
        if request.method == "GET" and tail == "health":
            return web.json_response(self.health())
        if request.method == "GET" and tail == "manifest":
            return self._manifest(request)
        if request.method == "POST" and tail == "sessions":
            return await self._open_session(request)
        if request.method == "DELETE" and tail.startswith("sessions/"):
            return await self._close_session(request, tail.removeprefix("sessions/"))
        return _error(404, "not_found", f"no p2p route {request.method} {request.path}")

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ok": True,
                "pod": self.pod,
                "identity": self.identity,
                "ranks": sorted(self.ranks),
                "agents": {r: s.agent_name for r, s in self.ranks.items()},
                "active_sessions": len(self._sessions),
                "completed_reads": self.completed_reads,
                "failed_reads": self.failed_reads,
                "expired_sessions": self.expired_sessions,
            }

    def _check(self, identity: str | None, rank_text: str | None) -> web.Response | RankSource:
        if identity is None or rank_text is None:
            return _error(400, "bad_request", "identity and rank are required")
        if identity != self.identity:
            return _error(
                409,
                "identity_mismatch",
                f"{self.pod} serves model identity {self.identity!r}, not {identity!r}",
            )
        try:
            rank = int(rank_text)
        except ValueError:
            return _error(400, "bad_request", f"rank {rank_text!r} is not an integer")
        source = self.ranks.get(rank)
        if source is None:
            return _error(
                404, "unknown_rank", f"{self.pod} holds ranks {sorted(self.ranks)}, not {rank}"
            )
        return source

    def _manifest(self, request: web.Request) -> web.Response:
        source = self._check(request.query.get("identity"), request.query.get("rank"))
        if isinstance(source, web.Response):
            return source
        return web.Response(body=source.manifest_body, content_type="application/json")

    async def _open_session(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "bad_request", "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "bad_request", "body must be a JSON object")
        source = self._check(body.get("identity"), str(body.get("rank")))
        if isinstance(source, web.Response):
            return source
        reader = str(body.get("reader", "?"))
        session = Session(id=uuid.uuid4().hex, reader=reader, rank=source.rank)
        with self._lock:
            self._sessions[session.id] = session
        return web.json_response(
            {"session": session.id, "lease_seconds": SESSION_LEASE_SECONDS}, status=201
        )

    async def _close_session(self, request: web.Request, session_id: str) -> web.Response:
        body: dict[str, Any] = {}
        if request.can_read_body:
            try:
                parsed = await request.json()
                body = parsed if isinstance(parsed, dict) else {}
            except ValueError:
                body = {}
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return _error(404, "unknown_session", f"no session {session_id}")
            if body.get("verified"):
                self.completed_reads += 1
            else:
                self.failed_reads += 1
        return web.json_response({"closed": session_id})

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            for sid in [
                s.id for s in self._sessions.values() if now - s.started > SESSION_LEASE_SECONDS
            ]:
                del self._sessions[sid]
                self.expired_sessions += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE_PUBLISHERS.discard(self)
        for source in self.ranks.values():
            source.close()


PUBLISHER_KEY: web.AppKey[SourcePublisher | None] = web.AppKey("p2p")


def p2p_app(publisher: SourcePublisher | None) -> web.Application:
    """A minimal aiohttp app that forwards the p2p prefix like the worker's server does (the
    same peer token check; small bodies only)."""
    app = web.Application(client_max_size=64 << 10)
    app[PUBLISHER_KEY] = publisher
    token = peer_token()

    async def forward(request: web.Request) -> web.StreamResponse:
        denied = refusal(request, token)
        if denied is not None:
            return denied
        pub = request.app[PUBLISHER_KEY]
        if pub is None:
            return _error(503, "not_a_source", "this worker is not a source yet")
        return await pub.handle(request)

    app.router.add_route("*", P2P_PREFIX + "/{tail:.*}", forward)
    return app
