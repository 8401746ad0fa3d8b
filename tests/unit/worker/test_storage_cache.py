"""The node-local cache without any store: commit, verify, mismatch, partial entries, LRU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from weightlift.worker.storage.cache import CacheMismatch, NodeCache


def _fill(cache: NodeCache, identity: str, files: dict[str, bytes]) -> Path:
    with cache.locked(identity) as entry:
        for name, data in files.items():
            (entry.partial / name).parent.mkdir(parents=True, exist_ok=True)
            (entry.partial / name).write_bytes(data)
        entry.commit("s3://b/m")
        return entry.files


def test_commit_records_size_and_digest_and_verify_accepts_it(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 1 << 30)
    files = _fill(cache, "a" * 16, {"model.safetensors": b"x" * 100, "hooks/lib.so": b"y"})
    manifest = json.loads((files.parent / "manifest.json").read_text())
    assert manifest["source"] == "s3://b/m"
    assert {k: v["size"] for k, v in manifest["files"].items()} == {
        "model.safetensors": 100,
        "hooks/lib.so": 1,
    }
    cache.entry("a" * 16).verify()


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p: p.write_bytes(b"x" * 99 + b"z"), "digest"),
        (lambda p: p.write_bytes(b"x" * 99), "has 99 bytes, 100 were recorded"),
        (lambda p: p.unlink(), "is missing"),
    ],
)
def test_a_damaged_entry_is_refused_naming_the_file(tmp_path: Path, damage, says: str) -> None:  # type: ignore[no-untyped-def]
    cache = NodeCache(tmp_path, 1 << 30)
    files = _fill(cache, "b" * 16, {"model.safetensors": b"x" * 100})
    damage(files / "model.safetensors")
    with pytest.raises(CacheMismatch, match=f"cache entry {'b' * 16}: model.safetensors .*{says}"):
        cache.entry("b" * 16).verify()


def test_a_download_that_died_half_way_is_not_an_entry(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 1 << 30)
    with cache.locked("c" * 16) as entry:
        entry.partial.mkdir()
        (entry.partial / "model.safetensors").write_bytes(b"half")
    assert not cache.entry("c" * 16).complete()


def test_lru_eviction_spares_the_newest_and_the_kept_entry(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 250)
    for i, ident in enumerate(("old", "mid", "new")):
        _fill(cache, ident, {"w.safetensors": b"x" * 100})
        os.utime(tmp_path / ident / "manifest.json", (1000 + i, 1000 + i))
    assert cache.evict(keep="new") == ["old"]
    assert cache.entry("mid").complete() and cache.entry("new").complete()
    assert not (tmp_path / "old" / "files").exists()
