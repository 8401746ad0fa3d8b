"""A store of compile caches that outlives replicas: a node directory, bounded in bytes (LRU).

A source that published its compile cache (compile_cache.publish) also puts each rank's archive
and manifest here; a replica with no Ready peer looks here before its vLLM starts. Entries are
the very manifests and archives a peer serves, installed through the same verifier
(compile_cache.check_entry, verify_and_install): nothing unverified is ever installed.

Layout: `<root>/<want>/<vllm hash>/{manifest.json,archive.tar}`, where `<want>` digests what a
replica knows before vLLM runs (`Wanted`: vLLM and torch versions, ISA, TP size, rank, model
identity) and `<vllm hash>` is vLLM's own key. An entry whose manifest names another key than
its place is mis-keyed and refused. An entry's directory mtime is its last use (LRU eviction).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from weightlift.api.worker import (
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    DEFAULT_COMPILE_STORE_MAX_BYTES,
)
from weightlift.worker.engines.vllm.compile_cache import (
    CacheKey,
    CacheManifest,
    CacheRejected,
    Installed,
    Packed,
    Wanted,
    check_entry,
    key_mismatch,
    verify_and_install,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ARCHIVE = "archive.tar"
_TMP = ".tmp-"


def node_store(environ: Mapping[str, str] | None = None) -> NodeStore | None:
    """The node store the operator named (COMPILE_STORE_ENV), or None."""
    env = os.environ if environ is None else environ
    path = env.get(COMPILE_STORE_ENV, "").strip()
    return NodeStore(Path(path), bound_from(env)) if path else None


def bound_from(env: Mapping[str, str]) -> int:
    try:
        return max(int(env.get(COMPILE_STORE_MAX_BYTES_ENV, "")), 0)
    except ValueError:
        return DEFAULT_COMPILE_STORE_MAX_BYTES


def want_digest(want: Wanted) -> str:
    """The store's directory for one rank's build (what is known before vLLM runs)."""
    doc = {f.name: getattr(want, f.name) for f in fields(Wanted)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


class CompileStore(ABC):
    """Entries under `<want>/<vllm hash>/`, kept within max_bytes by evicting the least recently
    used; a backend says how to list, read, write and remove them (a node directory, S3)."""

    label = "the store"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    # -------------------------------------------------------------------------- the backend
    @abstractmethod
    def hashes(self, want: str) -> list[str]:
        """vLLM hashes stored for one rank's build, the most recently used first."""

    @abstractmethod
    def has(self, want: str, vllm_hash: str) -> bool: ...

    @abstractmethod
    def manifest_text(self, want: str, vllm_hash: str) -> str: ...

    @abstractmethod
    def archive(self, want: str, vllm_hash: str, staging: Path, bound: int) -> Path:
        """The entry's archive as a local file (at most `bound` bytes, else CacheRejected)."""

    @abstractmethod
    def write(self, want: str, vllm_hash: str, archive: Path, manifest: str) -> None:
        """One entry, replacing any of the same key: readers see the old or the new whole."""

    @abstractmethod
    def touch(self, want: str, vllm_hash: str) -> None:
        """Mark a use (the last to be evicted)."""

    @abstractmethod
    def entries(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, "<want>/<vllm hash>") of every entry, least recently used first."""

    @abstractmethod
    def remove(self, entry: str) -> None:
        """One entry ("<want>/<vllm hash>") or every entry of a build ("<want>")."""

    # -------------------------------------------------------------------------- writing
    def put(self, packed: dict[int, Packed]) -> int:
        """Every rank's archive and manifest as entries (replacing any of the same key); then
        the oldest entries are evicted down to the bound. The bytes stored."""
        total = sum(p.archive.stat().st_size for p in packed.values())
        if total > self.max_bytes:
            log.info("compile cache of %d bytes not stored: over %d", total, self.max_bytes)
            return 0
        keep = set()
        for p in packed.values():
            key = p.manifest.key
            self.write(want_digest(key), key.vllm_hash, p.archive, json.dumps(p.manifest.wire()))
            keep.add(f"{want_digest(key)}/{key.vllm_hash}")
        self.evict(keep)
        return total

    def evict(self, keep: set[str] | None = None) -> list[str]:
        """Remove least recently used entries until the store holds at most max_bytes."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed: list[str] = []
        for _, size, entry in entries:
            if total <= self.max_bytes:
                break
            if keep and entry in keep:
                continue
            self.remove(entry)
            total -= size
            removed.append(entry)
        if removed:
            log.info(
                "%s: evicted %d entries (LRU) to stay within %d bytes",
                self,
                len(removed),
                self.max_bytes,
            )
        return removed

    # -------------------------------------------------------------------------- reading
    def find(self, wanted: list[Wanted]) -> tuple[str, list[CacheManifest]] | None:
        """The most recently used vLLM hash with every rank's entry, and their manifests; None
        when the store holds none. CacheRejected for a mis-keyed or unreadable manifest."""
        wants = [want_digest(w) for w in wanted]
        for vllm_hash in self.hashes(wants[0]):
            if all(self.has(d, vllm_hash) for d in wants[1:]):
                return vllm_hash, [
                    _read_manifest(self.manifest_text(d, vllm_hash), vllm_hash, w)
                    for d, w in zip(wants, wanted, strict=True)
                ]
        return None

    def install(self, wanted: list[Wanted], root: Path) -> Installed:
        """The newest entry for `wanted`, verified file by file and installed under `root`; or
        the reason nothing was (a refused entry is removed from the store)."""
        staging = root / f".weightlift-store-staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            found = self.find(wanted)
            if found is None:
                return Installed(reason=f"no compile cache for this build in {self}")
            vllm_hash, manifests = found
            plans: list[tuple[CacheManifest, Path | None]] = []
            for manifest, want in zip(manifests, wanted, strict=True):
                check_entry(manifest, want, self.max_bytes, f"{self}'s")
                # A tar holds a header per file and padding: a generous bound over the bytes.
                bound = manifest.total_bytes + 1024 * (len(manifest.files) + 4) + (1 << 20)
                where = staging / f"rank-{want.rank}"
                plans.append((manifest, self.archive(want_digest(want), vllm_hash, where, bound)))
            got = verify_and_install(plans, root, staging, self.label, "store")
        except CacheRejected as exc:
            return self._refused(wanted, exc)
        except OSError as exc:  # evicted meanwhile, unreachable: compile instead
            return Installed(reason=f"{self} unreadable: {exc}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for want in wanted:
            with contextlib.suppress(OSError):
                self.touch(want_digest(want), vllm_hash)
        return got

    def _refused(self, wanted: list[Wanted], exc: CacheRejected) -> Installed:
        log.warning("%s: entry refused: %s", self, exc)
        for want in wanted:  # a bad entry is dropped: the next Ready replica stores a good one
            with contextlib.suppress(OSError):
                self.remove(want_digest(want))
        return Installed(reason=f"store entry refused: {exc}")


class NodeStore(CompileStore):
    """A verified compile-cache directory on the node (a hostPath; on the process node a host
    directory), shared by the replicas that run there. An entry's mtime is its last use."""

    label = "the node store"

    def __init__(
        self,
        root: Path,
        max_bytes: int = DEFAULT_COMPILE_STORE_MAX_BYTES,
        label: str = "the node store",
    ) -> None:
        super().__init__(max_bytes)
        self.root = root
        self.label = label

    def __str__(self) -> str:
        return f"{self.label} {self.root}"

    def entry(self, key: CacheKey) -> Path:
        return self.root / want_digest(key) / key.vllm_hash

    def hashes(self, want: str) -> list[str]:
        base = self.root / want
        if not base.is_dir():
            return []
        found = [p for p in base.iterdir() if not p.name.startswith(_TMP)]
        return [p.name for p in sorted(found, key=_mtime, reverse=True)]

    def has(self, want: str, vllm_hash: str) -> bool:
        return (self.root / want / vllm_hash).is_dir()

    def manifest_text(self, want: str, vllm_hash: str) -> str:
        return (self.root / want / vllm_hash / MANIFEST).read_text()

    def archive(self, want: str, vllm_hash: str, staging: Path, bound: int) -> Path:
        path = self.root / want / vllm_hash / ARCHIVE
        if path.stat().st_size > bound:
            raise CacheRejected(f"{ARCHIVE} of {path.stat().st_size} bytes, over {bound}")
        return path  # read in place: the verifier copies what it checks

    def write(self, want: str, vllm_hash: str, archive: Path, manifest: str) -> None:
        dest = self.root / want / vllm_hash
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{_TMP}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            shutil.copyfile(archive, tmp / ARCHIVE)
            (tmp / MANIFEST).write_text(manifest)
            old = dest.parent / f"{_TMP}{uuid.uuid4().hex}"
            if dest.exists():
                os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def touch(self, want: str, vllm_hash: str) -> None:
        os.utime(self.root / want / vllm_hash)

    def entries(self) -> list[tuple[float, int, str]]:
        found = []
        for entry in self.root.glob("*/*"):
            if entry.name.startswith(_TMP) or not entry.is_dir():
                continue
            try:
                size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
                found.append((entry.stat().st_mtime, size, f"{entry.parent.name}/{entry.name}"))
            except OSError:  # removed meanwhile by another replica's eviction
                continue
        return sorted(found)

    def remove(self, entry: str) -> None:
        shutil.rmtree(self.root / entry, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read_manifest(text: str, vllm_hash: str, want: Wanted) -> CacheManifest:
    try:
        manifest = CacheManifest.from_wire(json.loads(text))
    except ValueError as exc:
        raise CacheRejected(f"store manifest of {vllm_hash[:12]} unreadable: {exc}") from exc
    # The place is the key: an entry holding another key's manifest is refused, not trusted.
    why = key_mismatch(manifest.key, want)
    if manifest.key.vllm_hash != vllm_hash:
        why = f"vLLM hash {manifest.key.vllm_hash[:12]} in the manifest, {vllm_hash[:12]} here"
    if why is not None:
        raise CacheRejected(f"mis-keyed entry {vllm_hash[:12]}: {why}")
    return manifest
