"""The node-local model cache: one verified directory per model identity, shared by the node's pods.

Layout under the cache root (a hostPath or local-PV directory):
  <identity>/files/...        the model files, exactly as the storage listed them
  <identity>/manifest.json    {"files": {name: {"size", "xxh3"}}, "source": uri}; written last
  <identity>.lock             flock: one downloader per identity per node
An entry without manifest.json is incomplete and never used: a download goes to
`<identity>/.partial/`, is hashed, renamed to `files/`, and only then gets its manifest. Before
use every file is checked against the manifest (size, then the xxh3-128 digest recorded at
download); a mismatch drops the entry and the caller downloads again. Eviction is LRU (the
manifest's mtime is touched on each use) down to the size cap, skipping entries that another pod
holds locked.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger("weightlift.worker.storage")

MANIFEST = "manifest.json"
_HASH_CHUNK = 16 << 20


def digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class CacheMismatch(Exception):
    """A cached file does not match what was recorded at download."""


@dataclass
class CacheEntry:
    root: Path

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def partial(self) -> Path:
        return self.root / ".partial"

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    def complete(self) -> bool:
        return self.manifest.is_file()

    def verify(self) -> None:
        """Raise CacheMismatch naming the first file whose size or digest differs."""
        doc = json.loads(self.manifest.read_text())
        for name, want in doc["files"].items():
            path = self.files / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CacheMismatch(f"cache entry {self.root.name}: {name} is missing") from None
            if size != want["size"]:
                raise CacheMismatch(
                    f"cache entry {self.root.name}: {name} has {size} bytes, "
                    f"{want['size']} were recorded at download"
                )
            got = digest(path)
            if got != want["xxh3"]:
                raise CacheMismatch(
                    f"cache entry {self.root.name}: {name} digest {got} does not match "
                    f"{want['xxh3']} recorded at download"
                )
        os.utime(self.manifest)  # LRU: last use

    def commit(self, source: str) -> None:
        """Hash the finished download in .partial/, move it to files/, then write the manifest."""
        files = {
            p.relative_to(self.partial).as_posix(): {"size": p.stat().st_size, "xxh3": digest(p)}
            for p in sorted(self.partial.rglob("*"))
            if p.is_file() and ".cache" not in p.relative_to(self.partial).parts
        }
        shutil.rmtree(self.files, ignore_errors=True)
        os.replace(self.partial, self.files)
        tmp = self.root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"source": source, "files": files}, indent=1))
        os.replace(tmp, self.manifest)

    def drop(self) -> None:
        """Forget the entry (manifest first, so nobody trusts the files meanwhile)."""
        self.manifest.unlink(missing_ok=True)
        shutil.rmtree(self.files, ignore_errors=True)
        shutil.rmtree(self.partial, ignore_errors=True)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files.rglob("*") if p.is_file())


class NodeCache:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def entry(self, identity: str) -> CacheEntry:
        return CacheEntry(self.root / identity)

    @contextmanager
    def locked(self, identity: str) -> Iterator[CacheEntry]:
        """The entry, held exclusively: concurrent pods on the node download once."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f"{identity}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entry = self.entry(identity)
                entry.root.mkdir(exist_ok=True)
                yield entry
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def evict(self, keep: str) -> list[str]:
        """Drop least recently used complete entries until the cache fits max_bytes."""
        entries = [
            (e.manifest.stat().st_mtime, e)
            for d in self.root.iterdir()
            if d.is_dir() and (e := CacheEntry(d)).complete()
        ]
        total = sum(e.size() for _, e in entries)
        dropped: list[str] = []
        for _, e in sorted(entries, key=lambda x: x[0]):
            if total <= self.max_bytes:
                break
            if e.root.name == keep:
                continue
            with (self.root / f"{e.root.name}.lock").open("a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use by another pod right now
                size = e.size()
                e.drop()
                fcntl.flock(lock, fcntl.LOCK_UN)
            total -= size
            dropped.append(e.root.name)
            log.info(
                "cache: evicted %s (%d bytes) to stay under %d bytes",
                e.root.name,
                size,
                self.max_bytes,
            )
        return dropped
