"""The node's compile-cache store: what a Ready replica puts is what a later one installs, through
the peers' verifier; a flipped byte, a truncated archive, a missing file or a mis-keyed entry is
refused with its reason, installs nothing and is dropped; the store keeps within its bytes by
evicting the least recently used entries. Real files and tar archives, vLLM's own layout."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.support.storage import minio
from tests.unit.worker.test_compile_cache import HASH, OTHER_HASH, WANTED, fake_cache
from weightlift.api.worker import (
    COMPILE_STORE_ACCESS_KEY_ENV,
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    COMPILE_STORE_S3_ENDPOINT_ENV,
    COMPILE_STORE_SECRET_KEY_ENV,
    COMPILE_STORE_SHARED_ENV,
    COMPILE_STORE_URI_ENV,
)
from weightlift.bench.chaos_models import flip_a_byte
from weightlift.local.s3server import MinioServer
from weightlift.worker.engines.vllm.compile_cache import (
    AOT_DIR,
    CacheKey,
    Packed,
    pack_rank,
)
from weightlift.worker.engines.vllm.compile_store import (
    ARCHIVE,
    MANIFEST,
    CompileStore,
    NodeStore,
    node_store,
    want_digest,
)
from weightlift.worker.engines.vllm.compile_stores import open_stores


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


# Puts the pickled {0: Packed} on stdin into the NodeStore at argv[1]; as root, first drops to
# uid = gid = argv[2] (no supplementary groups, for good), after its imports: the interpreter
# and the venv may sit where that user may not read (/root).
_PUT = """
import os, pickle, sys
from pathlib import Path
from weightlift.worker.engines.vllm.compile_store import NodeStore
packed = pickle.load(sys.stdin.buffer)
uid = int(sys.argv[2])
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
print(f"uid {os.geteuid()}:", end=" ")
try:
    stored = NodeStore(Path(sys.argv[1]), 1 << 20).put(packed)
except OSError as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
print(f"stored {stored}")
"""


def _put_elsewhere(root: Path, source: Packed, uid: int) -> tuple[int, str]:
    """`NodeStore(root).put` in a child process, as `uid` (-1: as we are): exit code, output."""
    done = subprocess.run(
        [sys.executable, "-c", _PUT, str(root), str(uid)],
        input=pickle.dumps({0: source}),
        capture_output=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=120,
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def test_a_store_that_cannot_be_written_raises_os_error_for_the_caller() -> None:
    """A store root its user may not write: the put raises OSError. Root writes anywhere, so as
    root (`make test` in CI) the put runs in a child process that drops to nobody (65534); that
    user must be able to put into a store it owns, and be refused by the root-owned one."""
    uid = 65534 if os.geteuid() == 0 else -1
    # Not below tmp_path: pytest's base temp is 0700, closed to nobody.
    base = Path(tempfile.mkdtemp(prefix="wl-store-perms-"))
    try:
        source = packed(base)
        for p in [base, *base.rglob("*")]:  # readable by all
            p.chmod(0o755 if p.is_dir() else 0o644)
        read_only = base / "read-only"
        read_only.mkdir()
        read_only.chmod(0o555)  # ours: no one else may write in it, nor we (unless root)
        writable = base / "writable"
        writable.mkdir()
        if uid >= 0:
            os.chown(writable, uid, uid)
        who = f"uid {os.geteuid() if uid < 0 else uid}:"
        code, out = _put_elsewhere(writable, source, uid)
        assert code == 0 and out == f"{who} stored {source.archive.stat().st_size}\n", out
        code, out = _put_elsewhere(read_only, source, uid)
        refused = f"{who} PermissionError: [Errno 13] Permission denied: '{read_only}/"
        assert code == 3 and out.startswith(refused), out
        assert list(read_only.iterdir()) == []
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir():
                p.chmod(0o700)
        shutil.rmtree(base)


def test_a_claim_shared_by_nodes_is_a_cluster_store_read_after_the_nodes(tmp_path: Path) -> None:
    env = {
        COMPILE_STORE_ENV: str(tmp_path / "node"),
        COMPILE_STORE_SHARED_ENV: str(tmp_path / "claim"),
        COMPILE_STORE_MAX_BYTES_ENV: str(1 << 20),
    }
    node, cluster = open_stores(env)
    assert str(node).startswith("the node store") and str(cluster).startswith("the cluster")
    cluster.put({0: packed(tmp_path)})  # another node's replica stored it
    assert node.install([WANTED], tmp_path / "r").vllm_hash is None
    got = cluster.install([WANTED], tmp_path / "r")
    assert got.vllm_hash == HASH and got.peer == "the cluster store", got


def test_the_store_comes_from_the_operators_env() -> None:
    assert node_store({}) is None and node_store({COMPILE_STORE_ENV: " "}) is None
    store = node_store({COMPILE_STORE_ENV: "/var/cache/wl", COMPILE_STORE_MAX_BYTES_ENV: "42"})
    assert store is not None and store.root == Path("/var/cache/wl") and store.max_bytes == 42


# ------------------------------------------------------------------------------ the cluster store
@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    yield from minio(tmp_path_factory.mktemp("minio"))


def s3_at(server: MinioServer, bucket: str, max_bytes: int, secret: str = "") -> CompileStore:
    server.make_bucket(bucket)
    env = {
        COMPILE_STORE_URI_ENV: f"s3://{bucket}/wl/cc",
        COMPILE_STORE_MAX_BYTES_ENV: str(max_bytes),
        COMPILE_STORE_S3_ENDPOINT_ENV: server.endpoint,
        COMPILE_STORE_ACCESS_KEY_ENV: server.access_key,
        COMPILE_STORE_SECRET_KEY_ENV: secret or server.secret_key,
    }
    (store,) = open_stores(env)
    return store


def test_the_s3_store_installs_verified_refuses_a_flipped_byte_and_evicts_lru(
    s3: MinioServer, tmp_path: Path
) -> None:
    store = s3_at(s3, "cc-one", 1 << 20)
    source = packed(tmp_path)
    assert store.put({0: source}) > 0
    got = store.install([WANTED], tmp_path / "r1")
    assert got.vllm_hash == HASH and got.via == "store" and got.reason == "", got
    assert installed_files(tmp_path / "r1") == sorted(f.path for f in source.manifest.files)
    # A flipped byte in the stored archive: refused, nothing installed, the entry dropped.
    key = f"wl/cc/{want_digest(WANTED)}/{HASH}/{ARCHIVE}"
    local = tmp_path / "downloaded.tar"
    s3.client().download_file("cc-one", key, str(local))
    flip_a_byte(local)
    s3.client().upload_file(str(local), "cc-one", key)
    bad = store.install([WANTED], tmp_path / "r2")
    assert bad.vllm_hash is None and "sha256 differs from the manifest" in bad.reason, bad
    assert not (tmp_path / "r2").exists() or installed_files(tmp_path / "r2") == []
    assert store.entries() == []
    # LRU within the bound: three entries, room for two; the one used last survives.
    a, b, c = (packed(tmp_path, f"{n:x}" * 64, f"s{n}") for n in (10, 11, 12))
    size = a.archive.stat().st_size + len(json.dumps(a.manifest.wire()))
    lru = s3_at(s3, "cc-lru", 2 * size + size // 2)
    lru.put({0: a})
    time.sleep(1.1)  # S3 dates to the second
    lru.put({0: b})
    time.sleep(1.1)
    lru.touch(want_digest(WANTED), a.manifest.key.vllm_hash)  # a used: b is now the oldest
    time.sleep(1.1)
    lru.put({0: c})
    kept = {e for _, _, e in lru.entries()}
    digest = want_digest(WANTED)
    assert kept == {f"{digest}/{a.manifest.key.vllm_hash}", f"{digest}/{c.manifest.key.vllm_hash}"}


def test_an_s3_store_refusing_the_credentials_is_an_os_error_without_them(
    s3: MinioServer, tmp_path: Path
) -> None:
    wrong = "not-the-secret-key-0123"
    store = s3_at(s3, "cc-creds", 1 << 20, secret=wrong)
    with pytest.raises(OSError) as err:
        store.put({0: packed(tmp_path)})
    assert "SignatureDoesNotMatch" in str(err.value) and wrong not in str(err.value)
    got = store.install([WANTED], tmp_path / "r")
    assert got.vllm_hash is None and "unreadable" in got.reason and wrong not in got.reason
