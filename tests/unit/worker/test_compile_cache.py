"""The compile cache's bad input, each case a miss with its reason and nothing installed: another
vLLM or torch version, TP size, rank or model; a corrupted, truncated or padded artifact; a source
without a cache; one over the bound. Real files, real tar archives and the worker's real HTTP
surface (aiohttp, with the peer bearer token); vLLM's log lines as vLLM 0.32 writes them."""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from weightlift.api.model import ModelFormat, ModelSource
from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.vllm.compile_cache import (
    AOT_DIR,
    CacheKey,
    CacheManifest,
    CacheRejected,
    CacheRoutes,
    Installed,
    Wanted,
    cpu_isa,
    fetch_and_install,
    key_mismatch,
    outcome,
    pack_rank,
    publish,
    read_compiles,
    verify_archive,
)
from weightlift.worker.server import WorkerState, build_app, set_p2p_handler

HASH = "36018555640d91943f8a1154443d7dea46f07fd8a4d59c2ad8c65b890e87d01c"
OTHER_HASH = "20ea941caf05ba1a06200000000000000000000000000000000000000000000a"
WANTED = Wanted("0.32.0+cpu", "2.13.0", "cpu:x86_64+avx2", 1, 0, "llm-tiny")
TOKEN = "peer-token-for-tests"


def fake_cache(root: Path, vllm_hash: str = HASH, ranks: int = 1) -> None:
    """The layout vLLM 0.32 writes: a program per rank and a shared Inductor kernel cache."""
    base = root / AOT_DIR / vllm_hash
    for rank in range(ranks):
        (base / f"rank_{rank}_0").mkdir(parents=True)
        (base / f"rank_{rank}_0" / "model").write_bytes(bytes([rank]) * 5000)
    for name, data in {"ih/kernel.cpp": b"void k() {}\n", "ih/kernel.so": b"\x7fELF" * 900}.items():
        (base / "inductor_cache" / name).parent.mkdir(parents=True, exist_ok=True)
        (base / "inductor_cache" / name).write_bytes(data)


def key(**changes: object) -> CacheKey:
    base = CacheKey(**asdict(WANTED), vllm_hash=HASH)
    return replace(base, **changes)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ keys
@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"vllm": "0.31.0"}, "vllm '0.31.0' in the cache, '0.32.0+cpu' here"),
        ({"torch": "2.12.0"}, "torch '2.12.0' in the cache, '2.13.0' here"),
        ({"tensor_parallel": 2}, "tensor parallel 2 in the cache, 1 here"),
        ({"rank": 1}, "rank 1 in the cache, 0 here"),
        ({"model_identity": "other"}, "model identity 'other' in the cache, 'llm-tiny' here"),
        ({"isa": "cpu:x86_64+avx2+avx512f"}, "isa 'cpu:x86_64+avx2+avx512f' in the cache"),
    ],
)
def test_a_cache_for_another_build_is_a_miss_naming_the_factor(
    changes: dict[str, object], reason: str
) -> None:
    why = key_mismatch(key(**changes), WANTED)
    assert why is not None and why.startswith(reason), why


def test_a_matching_key_is_left_to_vllm_to_check_its_own_hash() -> None:
    assert key_mismatch(key(vllm_hash=OTHER_HASH), WANTED) is None


def test_cpu_isa_names_the_vector_extensions_inductor_builds_for() -> None:
    info = "processor : 0\nflags : fpu sse2 avx avx2 fma avx512f amx_tile\n"
    assert cpu_isa(info, "x86_64") == "cpu:x86_64+avx2+avx512f+amx_tile"
    assert cpu_isa("Features : fp asimd sve\n", "aarch64") == "cpu:aarch64+asimd+sve"


# ------------------------------------------------------------------------------ vLLM's log
SAVED_LINE = (
    "(EngineCore pid=3315) INFO 11-24 02:52:46 [decorators.py:743] [backbone] saved AOT compiled "
    "function to /c/torch_compile_cache/torch_aot_compile/{h}/rank_{r}_0/model"
)
LOADED_LINE = (
    "(EngineCore pid=4074) INFO 11-24 02:53:13 [decorators.py:319] [backbone] Directly load AOT "
    "compilation from path /c/torch_compile_cache/torch_aot_compile/{h}/rank_{r}_0/model"
)
FAILED_LINE = (
    "(EngineCore pid=1) WARNING 11-24 02:58:18 [decorators.py:333] [backbone] Compiling model "
    "again due to a load failure from /c/torch_compile_cache/torch_aot_compile/{h}/rank_0_0/model, "
    "reason: 'function' object has no attribute 'finalize_loading'"
)


def test_outcome_reads_what_vllm_did() -> None:
    hit = read_compiles(LOADED_LINE.format(h=HASH, r=0))
    assert outcome(Installed(vllm_hash=HASH, peer="llm-0", via="peer"), hit, 1) == "hit (peer)"
    store = Installed(vllm_hash=HASH, peer="the node store", via="store")
    assert outcome(store, hit, 1) == "hit (store)"
    # Nothing installed, yet loaded: a cache root that outlived a replica on this node.
    assert outcome(None, hit, 1) == "hit (store)"
    # No compiled program at all (--enforce-eager) and nothing offered.
    assert outcome(None, read_compiles("Loading weights took 0.01 seconds"), 1) == "none"
    # A source that compiled: nothing was offered to it.
    assert outcome(None, read_compiles(SAVED_LINE.format(h=HASH, r=0)), 1) == "none"
    # Installed, but vLLM's own key differed (another engine argument): it compiled under
    # another hash.
    saved = read_compiles(SAVED_LINE.format(h=OTHER_HASH, r=0))
    text = outcome(Installed(vllm_hash=HASH, peer="llm-0"), saved, 1)
    assert text.startswith("miss (vLLM's cache key differs: 360185556") and "20ea941caf05" in text
    # vLLM could not load it: the failure's reason survives the save that follows.
    log = FAILED_LINE.format(h=HASH) + "\n" + SAVED_LINE.format(h=HASH, r=0)
    assert read_compiles(log)[0].action == "saved"
    assert outcome(None, read_compiles(log), 1) == (
        "miss (vLLM could not load it: 'function' object has no attribute 'finalize_loading')"
    )
    # Refused before vLLM started: the reason.
    refused = Installed(reason="torch '2.12.0' in the cache, '2.13.0' here")
    assert outcome(refused, saved, 1) == "miss (torch '2.12.0' in the cache, '2.13.0' here)"
    # TP 2 with one rank loaded and one compiled is not a hit.
    mixed = read_compiles(LOADED_LINE.format(h=HASH, r=0) + "\n" + SAVED_LINE.format(h=HASH, r=1))
    assert outcome(Installed(vllm_hash=HASH, peer="p"), mixed, 2).startswith("miss (")


# ------------------------------------------------------------------------------ archives
def packed(tmp_path: Path) -> tuple[Path, CacheManifest]:
    src = tmp_path / "src"
    fake_cache(src)
    manifest = pack_rank(src, key(), tmp_path / "rank-0.tar")
    return tmp_path / "rank-0.tar", manifest


def test_pack_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    archive, manifest = packed(tmp_path)
    names = sorted(f.path for f in manifest.files)
    assert names == [
        f"{AOT_DIR}/{HASH}/inductor_cache/ih/kernel.cpp",
        f"{AOT_DIR}/{HASH}/inductor_cache/ih/kernel.so",
        f"{AOT_DIR}/{HASH}/rank_0_0/model",
    ]
    model = tmp_path / "src" / AOT_DIR / HASH / "rank_0_0" / "model"
    entry = next(f for f in manifest.files if f.path.endswith("/model"))
    assert entry.size == 5000 and entry.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    assert CacheManifest.from_wire(manifest.wire()) == manifest
    staged = verify_archive(archive, manifest, tmp_path / "staging")
    assert sorted(staged) == names
    assert (tmp_path / "staging" / names[2]).read_bytes() == model.read_bytes()


def _rewrite(archive: Path, name_suffix: str, data: bytes) -> None:
    """The archive again with one member's bytes replaced (same manifest)."""
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(archive, "w") as tar:
        for member, body in members:
            body = data if member.name.endswith(name_suffix) else body
            member.size = len(body)
            tar.addfile(member, io.BytesIO(body))


def test_a_corrupted_file_is_refused_by_its_checksum_naming_it(tmp_path: Path) -> None:
    archive, manifest = packed(tmp_path)
    _rewrite(archive, "kernel.so", b"\x7fELF" * 899 + b"evil")
    with pytest.raises(CacheRejected, match=r"inductor_cache/ih/kernel.so: sha256 differs"):
        verify_archive(archive, manifest, tmp_path / "staging")


def test_a_resized_file_is_refused_naming_it(tmp_path: Path) -> None:
    archive, manifest = packed(tmp_path)
    _rewrite(archive, "/model", b"\x00" * 10)
    with pytest.raises(CacheRejected, match=r"rank_0_0/model: 10 bytes, the manifest says 5000"):
        verify_archive(archive, manifest, tmp_path / "staging")


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    archive, manifest = packed(tmp_path)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheRejected, match=r"unreadable|missing|bytes, the manifest says"):
        verify_archive(archive, manifest, tmp_path / "staging")


def test_a_file_outside_the_manifest_or_the_hash_dir_is_refused(tmp_path: Path) -> None:
    archive, manifest = packed(tmp_path)
    manifest.files[0] = replace(manifest.files[0], path="../../etc/passwd")
    with pytest.raises(CacheRejected, match=r"'../../etc/passwd' lies outside"):
        verify_archive(archive, manifest, tmp_path / "staging")
    archive, manifest = packed(tmp_path / "again")
    dropped = manifest.files.pop()
    with pytest.raises(CacheRejected, match=f"{dropped.path} is not in the manifest"):
        verify_archive(archive, manifest, tmp_path / "staging2")


def test_publish_packs_each_rank_within_the_bound(tmp_path: Path) -> None:
    root = tmp_path / "root"
    fake_cache(root, ranks=2)
    log = SAVED_LINE.format(h=HASH, r=0) + "\n" + LOADED_LINE.format(h=HASH, r=1)
    tp2 = replace(WANTED, tensor_parallel=2)
    out, why = publish(root, read_compiles(log), tp2, tmp_path / "out", 1 << 20)
    assert why == "" and sorted(out) == [0, 1]
    assert out[1].manifest.key.rank == 1 and out[1].manifest.key.vllm_hash == HASH
    assert any(f.path.endswith("rank_1_0/model") for f in out[1].manifest.files)
    assert not any("rank_0_0" in f.path for f in out[1].manifest.files)
    none, why = publish(root, read_compiles(log), tp2, tmp_path / "out2", 1000)
    assert none == {} and "over 1000" in why
    none, why = publish(root, {}, WANTED, tmp_path / "out3", 1 << 20)
    assert none == {} and "--enforce-eager" in why


# ------------------------------------------------------------------------------ over HTTP
@pytest.fixture
async def source(tmp_path: Path) -> AsyncIterator[tuple[str, CacheRoutes]]:
    """A worker's real front door holding a packed cache, behind the peer token."""
    root = tmp_path / "source-root"
    fake_cache(root)
    packed_ranks, why = publish(
        root, read_compiles(SAVED_LINE.format(h=HASH, r=0)), WANTED, tmp_path / "packed", 1 << 20
    )
    plan = WorkerPlan(
        deployment="llm",
        pod_name="llm-0",
        model_identity="llm-tiny",
        model=ModelSource(uri="file:///m", format=ModelFormat.SAFETENSORS),
        model_dir="/m",
        served_model_name="llm",
    )
    state = WorkerState.for_plan(plan)
    state.peer_token = TOKEN
    app = build_app(state)
    routes = CacheRoutes(None, packed_ranks, why)
    set_p2p_handler(app, routes)
    server = TestServer(app)
    await server.start_server()
    try:
        yield f"{server.host}:{server.port}", routes
    finally:
        await server.close()


async def _fetch(
    address: str, root: Path, wanted: Wanted = WANTED, bound: int = 1 << 20, token: str = TOKEN
) -> Installed:
    async with aiohttp.ClientSession() as session:
        return await fetch_and_install(
            session,
            [("llm-0", address)],
            {"Authorization": f"Bearer {token}"},
            [wanted],
            root,
            bound,
        )


async def test_a_target_installs_a_verified_cache_where_vllm_looks(
    source: tuple[str, CacheRoutes], tmp_path: Path
) -> None:
    address, _ = source
    root = tmp_path / "target-root"
    got = await _fetch(address, root)
    assert got.vllm_hash == HASH and got.peer == "llm-0" and got.files == 3, got
    model = root / AOT_DIR / HASH / "rank_0_0" / "model"
    assert model.read_bytes() == bytes([0]) * 5000
    assert not list(root.glob(".weightlift-staging-*"))
    # Again on the same node: it holds the very files, nothing is fetched.
    again = await _fetch(address, root)
    assert again.vllm_hash == HASH and again.files == 0, again
    # One file changed on this node: fetched and verified again, the good copy back.
    model.write_bytes(b"stale")
    healed = await _fetch(address, root)
    assert healed.files == 3 and model.read_bytes() == bytes([0]) * 5000, healed


async def test_bad_offers_are_misses_and_install_nothing(
    source: tuple[str, CacheRoutes], tmp_path: Path
) -> None:
    address, routes = source
    root = tmp_path / "target-root"
    got = await _fetch(address, root, wanted=replace(WANTED, torch="2.12.0"))
    assert got.vllm_hash is None and "torch '2.13.0' in the cache, '2.12.0' here" in got.reason
    got = await _fetch(address, root, wanted=replace(WANTED, tensor_parallel=2, rank=1))
    assert "no compile cache for rank 1" in got.reason, got
    got = await _fetch(address, root, bound=100)
    assert "over 100" in got.reason, got
    got = await _fetch(address, root, token="wrong-token-for-tests")
    assert "answered 403" in got.reason, got
    # A corrupted archive on the source: refused by its checksum, naming the file.
    _rewrite(routes.packed[0].archive, "kernel.cpp", b"void k() { evil(); }\n"[:12])
    got = await _fetch(address, root)
    assert "inductor_cache/ih/kernel.cpp: sha256 differs" in got.reason, got
    # A source without a cache.
    routes.packed.clear()
    routes.why_none = "vLLM logged no compiled program for every rank (--enforce-eager?)"
    got = await _fetch(address, root)
    assert "offers no compile cache: vLLM logged no compiled program" in got.reason, got
    assert not (root / AOT_DIR).exists()
    assert outcome(got, {}, 1).startswith("miss (llm-0 offers no compile cache")


async def test_an_unreachable_peer_is_a_miss(tmp_path: Path) -> None:
    from weightlift.local.net import free_port

    got = await _fetch(f"127.0.0.1:{free_port()}", tmp_path / "root")
    assert got.vllm_hash is None and "unreachable" in got.reason, got


async def test_a_frozen_peer_is_a_miss_within_the_read_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that accepts the connection and never answers (a SIGSTOPped source) fails the
    fetch at the per-read timeout, not at the session's total: vLLM is not held back."""
    from weightlift.worker.engines.vllm import compile_cache

    monkeypatch.setattr(
        compile_cache, "PEER_TIMEOUT", aiohttp.ClientTimeout(total=None, sock_read=0.5)
    )

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        started = time.monotonic()
        got = await asyncio.wait_for(_fetch(f"127.0.0.1:{port}", tmp_path / "root"), timeout=30)
        assert time.monotonic() - started < 10
    finally:
        server.close()
    assert got.vllm_hash is None and "unreachable" in got.reason, got
