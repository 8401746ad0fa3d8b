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

import hashlib
import json
import logging
import os
import shutil
import uuid
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
    if not path:
        return None
    try:
        bound = max(int(env.get(COMPILE_STORE_MAX_BYTES_ENV, "")), 0)
    except ValueError:
        bound = DEFAULT_COMPILE_STORE_MAX_BYTES
    return NodeStore(Path(path), bound)


def want_digest(want: Wanted) -> str:
    """The store's directory for one rank's build (what is known before vLLM runs)."""
    doc = {f.name: getattr(want, f.name) for f in fields(Wanted)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


class NodeStore:
    """A verified compile-cache directory on the node (a hostPath; on the process node a host
    directory), shared by the replicas that run there."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_COMPILE_STORE_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def __str__(self) -> str:
        return f"the node store {self.root}"

    # -------------------------------------------------------------------------- writing
    def put(self, packed: dict[int, Packed]) -> int:
        """Every rank's archive and manifest as entries (replacing any of the same key); then
        the oldest entries are evicted down to the bound. The bytes stored."""
        total = sum(p.archive.stat().st_size for p in packed.values())
        if total > self.max_bytes:
            log.info("compile cache of %d bytes not stored: over %d", total, self.max_bytes)
            return 0
        for p in packed.values():
            self._put_one(p)
        self.evict(keep={self.entry(p.manifest.key) for p in packed.values()})
        return total

    def entry(self, key: CacheKey) -> Path:
        return self.root / want_digest(key) / key.vllm_hash

    def _put_one(self, packed: Packed) -> None:
        dest = self.entry(packed.manifest.key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{_TMP}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            shutil.copyfile(packed.archive, tmp / ARCHIVE)
            (tmp / MANIFEST).write_text(json.dumps(packed.manifest.wire()))
            old = dest.parent / f"{_TMP}{uuid.uuid4().hex}"
            if dest.exists():  # readers see the old entry or the new, never half of one
                os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, directory) of every entry, least recently used first."""
        found = []
        for entry in self.root.glob("*/*"):
            if entry.name.startswith(_TMP) or not entry.is_dir():
                continue
            try:
                size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
                found.append((entry.stat().st_mtime, size, entry))
            except OSError:  # removed meanwhile by another replica's eviction
                continue
        return sorted(found)

    def evict(self, keep: set[Path] | None = None) -> list[Path]:
        """Remove least recently used entries until the store holds at most max_bytes."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed: list[Path] = []
        for _, size, entry in entries:
            if total <= self.max_bytes:
                break
            if keep and entry in keep:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            removed.append(entry)
        if removed:
            log.info(
                "compile store: evicted %d entries (LRU) to stay within %d bytes",
                len(removed),
                self.max_bytes,
            )
        return removed

    # -------------------------------------------------------------------------- reading
    def find(self, wanted: list[Wanted]) -> list[tuple[CacheManifest, Path]] | None:
        """Every rank's entry of one vLLM hash, the most recently used first; None when the
        store holds none. CacheRejected for an entry that exists but is mis-keyed or unreadable.
        """
        first = self.root / want_digest(wanted[0])
        if not first.is_dir():
            return None
        hashes = [p.name for p in sorted(first.iterdir(), key=_mtime, reverse=True)]
        for vllm_hash in (h for h in hashes if not h.startswith(_TMP)):
            dirs = [self.root / want_digest(w) / vllm_hash for w in wanted]
            if all(d.is_dir() for d in dirs):
                return [
                    (_read_manifest(d, vllm_hash, w), d / ARCHIVE)
                    for d, w in zip(dirs, wanted, strict=True)
                ]
        return None

    def install(self, wanted: list[Wanted], root: Path) -> Installed:
        """The newest entry for `wanted`, verified file by file and installed under `root`; or
        the reason nothing was (a refused entry is removed from the store)."""
        try:
            plans = self.find(wanted)
        except CacheRejected as exc:
            return self._refused(wanted, exc)
        if plans is None:
            return Installed(reason=f"no compile cache for this build in {self}")
        staging = root / f".weightlift-store-staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            for (manifest, _), want in zip(plans, wanted, strict=True):
                check_entry(manifest, want, self.max_bytes, f"{self}'s")
            got = verify_and_install(list(plans), root, staging, "the node store", "store")
        except CacheRejected as exc:
            return self._refused(wanted, exc)
        except OSError as exc:  # evicted meanwhile, unreadable: compile instead
            return Installed(reason=f"{self} unreadable: {exc}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for _, archive in plans:  # a use: last to be evicted
            os.utime(archive.parent)
        return got

    def _refused(self, wanted: list[Wanted], exc: CacheRejected) -> Installed:
        log.warning("compile store entry refused: %s", exc)
        for want in wanted:  # a bad entry is dropped: the next Ready replica stores a good one
            shutil.rmtree(self.root / want_digest(want), ignore_errors=True)
        return Installed(reason=f"store entry refused: {exc}")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read_manifest(entry: Path, vllm_hash: str, want: Wanted) -> CacheManifest:
    try:
        manifest = CacheManifest.from_wire(json.loads((entry / MANIFEST).read_text()))
    except (OSError, ValueError) as exc:
        raise CacheRejected(f"store manifest {entry / MANIFEST} unreadable: {exc}") from exc
    # The place is the key: an entry holding another key's manifest is refused, not trusted.
    why = key_mismatch(manifest.key, want)
    if manifest.key.vllm_hash != vllm_hash:
        why = f"vLLM hash {manifest.key.vllm_hash[:12]} in the manifest, {vllm_hash[:12]} here"
    if why is not None:
        raise CacheRejected(f"mis-keyed entry {entry.name[:12]}: {why}")
    return manifest
