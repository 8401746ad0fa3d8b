"""The node's compile-cache store: what a Ready replica puts is what a later one installs, through
the peers' verifier; a flipped byte, a truncated archive, a missing file or a mis-keyed entry is
refused with its reason, installs nothing and is dropped; the store keeps within its bytes by
evicting the least recently used entries. Real files and tar archives, vLLM's own layout."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.unit.worker.test_compile_cache import HASH, OTHER_HASH, WANTED, fake_cache
from weightlift.api.worker import COMPILE_STORE_ENV, COMPILE_STORE_MAX_BYTES_ENV
from weightlift.worker.engines.vllm.compile_cache import (
    AOT_DIR,
    CacheKey,
    Packed,
    pack_rank,
)
from weightlift.worker.engines.vllm.compile_store import (
    ARCHIVE,
    MANIFEST,
    NodeStore,
    node_store,
    want_digest,
)


def packed(tmp_path: Path, vllm_hash: str = HASH, name: str = "src", **changes: object) -> Packed:
    """A Ready source's rank-0 archive and manifest, as compile_cache.publish makes them."""
    root = tmp_path / name
    fake_cache(root, vllm_hash)
    key = replace(CacheKey(**asdict(WANTED), vllm_hash=vllm_hash), **changes)  # type: ignore[arg-type]
    archive = tmp_path / f"{name}.tar"
    return Packed(pack_rank(root, key, archive), archive)


def installed_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_an_entry_put_by_a_source_is_installed_verified_where_vllm_looks(tmp_path: Path) -> None:
    store = NodeStore(tmp_path / "store", 1 << 20)
    source = packed(tmp_path)
    assert store.put({0: source}) == source.archive.stat().st_size
    root = tmp_path / "replica"
    got = store.install([WANTED], root)
    assert got.reason == "" and got.vllm_hash == HASH and got.via == "store", got
    assert got.files == len(source.manifest.files) == 3  # the program and two kernel files
    expected = sorted(f.path for f in source.manifest.files)
    assert installed_files(root) == expected
    assert all(p.startswith(f"{AOT_DIR}/{HASH}/") for p in expected)
    assert (root / AOT_DIR / HASH / "rank_0_0" / "model").read_bytes() == bytes([0]) * 5000


def test_keying_another_build_finds_nothing(tmp_path: Path) -> None:
    store = NodeStore(tmp_path / "store", 1 << 20)
    store.put({0: packed(tmp_path)})
    for other in (
        replace(WANTED, torch="2.12.0"),
        replace(WANTED, vllm="0.31.0"),
        replace(WANTED, isa="cuda:sm_90"),
        replace(WANTED, model_identity="other"),
        replace(WANTED, rank=1),
    ):
        assert want_digest(other) != want_digest(WANTED)
        got = store.install([other], tmp_path / "r")
        assert got.vllm_hash is None and got.reason.startswith("no compile cache for this build")
        assert not (tmp_path / "r").exists() or installed_files(tmp_path / "r") == []
    # TP 2 needs both ranks' entries under one vLLM hash: rank 0 alone is not enough.
    tp2 = [replace(WANTED, tensor_parallel=2, rank=r) for r in (0, 1)]
    assert store.install(tp2, tmp_path / "r").vllm_hash is None


def flip_a_byte(archive: Path) -> None:
    """One bit of the compiled program's bytes (not a tar header: the checksum must catch it)."""
    with tarfile.open(archive) as tar:
        offset = next(m.offset_data for m in tar if m.name.endswith("/model"))
    with archive.open("r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x01]))


def _truncate(archive: Path) -> None:
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])


def _drop_archive(archive: Path) -> None:
    archive.unlink()


def _mis_key(archive: Path) -> None:
    """The entry's manifest says another vLLM hash than the place it was found under."""
    manifest = archive.parent / MANIFEST
    doc = json.loads(manifest.read_text())
    doc["key"]["vllm_hash"] = OTHER_HASH
    manifest.write_text(json.dumps(doc))


def _mis_key_model(archive: Path) -> None:
    manifest = archive.parent / MANIFEST
    doc = json.loads(manifest.read_text())
    doc["key"]["model_identity"] = "another-model"
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (flip_a_byte, "sha256 differs from the manifest"),
        (_truncate, "truncated?"),
        (_drop_archive, "unreadable"),
        (_mis_key, "mis-keyed entry"),
        (_mis_key_model, "model identity 'another-model' in the cache, 'llm-tiny' here"),
    ],
)
def test_a_bad_entry_is_refused_with_its_reason_installs_nothing_and_is_dropped(
    tmp_path: Path, damage: object, reason: str
) -> None:
    store = NodeStore(tmp_path / "store", 1 << 20)
    store.put({0: packed(tmp_path)})
    entry = store.entry(CacheKey(**asdict(WANTED), vllm_hash=HASH))
    damage(entry / ARCHIVE)  # type: ignore[operator]
    root = tmp_path / "replica"
    got = store.install([WANTED], root)
    assert got.vllm_hash is None and reason in got.reason, got.reason
    assert got.reason.startswith(("store entry refused: ", "the node store")), got.reason
    assert not root.exists() or installed_files(root) == []
    if got.reason.startswith("store entry refused"):
        assert not entry.exists()  # the next Ready replica stores a good one


def test_the_store_evicts_least_recently_used_entries_to_its_bound(tmp_path: Path) -> None:
    a, b, c = (packed(tmp_path, f"{n:x}" * 64, f"s{n}") for n in (10, 11, 12))
    size = a.archive.stat().st_size
    store = NodeStore(tmp_path / "store", 2 * size + size // 2)  # room for two entries
    store.put({0: a})
    store.put({0: b})
    ea, eb = (store.entry(p.manifest.key) for p in (a, b))
    os.utime(ea, (1_000, 1_000))
    os.utime(eb, (2_000, 2_000))
    got = store.install([WANTED], tmp_path / "r")  # the newest entry (b) is used: now the newest
    assert got.vllm_hash == b.manifest.key.vllm_hash
    os.utime(ea, (3_000, 3_000))  # then a is used: b is now least recently used
    os.utime(eb, (1_500, 1_500))
    store.put({0: c})
    assert ea.is_dir() and not eb.exists() and store.entry(c.manifest.key).is_dir()
    assert sum(s for _, s, _ in store.entries()) <= store.max_bytes
    # An archive bigger than the whole store is not stored (and evicts nothing).
    tiny = NodeStore(tmp_path / "tiny", size - 1)
    assert tiny.put({0: a}) == 0 and tiny.entries() == []


def test_a_store_that_cannot_be_written_raises_os_error_for_the_caller(tmp_path: Path) -> None:
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(OSError):
            NodeStore(root, 1 << 20).put({0: packed(tmp_path)})
    finally:
        root.chmod(0o700)
        shutil.rmtree(root)


def test_the_store_comes_from_the_operators_env() -> None:
    assert node_store({}) is None and node_store({COMPILE_STORE_ENV: " "}) is None
    store = node_store({COMPILE_STORE_ENV: "/var/cache/wl", COMPILE_STORE_MAX_BYTES_ENV: "42"})
    assert store is not None and store.root == Path("/var/cache/wl") and store.max_bytes == 42
