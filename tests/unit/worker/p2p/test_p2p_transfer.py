"""NIXL between processes on loopback: a source process publishes, this process pulls.

Covers: two-process transfer with every checksum verified (bit-equal to the files; xxh3 and
dev64), refusal of another identity / unknown rank, shape and dtype mismatches against the
target's own files, checksum mismatch (the source's bytes changed under it; xxh3 and dev64), a
killed source detected fast and reported as LoadError (then the storage fallback), a dead
candidate skipped for a live one, and a source that keeps serving after its reader was killed
mid-transfer (ModelExpress #555).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.p2p import ThreadSource, needs_nixl, source_process
from weightlift.api.model import ChecksumSetting
from weightlift.api.worker import PeerCandidate
from weightlift.bench.peer import storage_load
from weightlift.local.sharded import make_plan, write_sharded_model
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.p2p import P2P_PREFIX
from weightlift.worker.p2p.target import PullOptions
from weightlift.worker.weights.progress import LoadError, LoadProgress

pytestmark = [needs_nixl, pytest.mark.timeout(120)]
CPU = torch.device("cpu")
FAST = PullOptions(
    transfer_timeout_s=5,
    stall_seconds=3,
    liveness_interval_s=0.25,
    batch_bytes=256 << 10,
    chunk_bytes=256 << 10,
)


def reference(model_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / f"rank-{rank}-of-2.safetensors"))


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(
            got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)
        ), k


@pytest.fixture(scope="module")
def source(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerCandidate]:
    with source_process(model_dir, tmp_path_factory.mktemp("src")) as (_, cand):
        yield cand


def target_plan(model_dir: Path, peers: list[PeerCandidate], **kw: object):  # type: ignore[no-untyped-def]
    return make_plan(model_dir, pod="tgt-0", role="Target", peers=peers, **kw)  # type: ignore[arg-type]


def test_two_process_transfer_verified(model_dir: Path, source: PeerCandidate) -> None:
    plan = target_plan(model_dir, [source])
    for rank in (0, 1):
        progress = LoadProgress()
        loader = PeerToPeerLoader(options=FAST)
        got = loader.load(plan, rank, CPU, progress)
        assert_bit_equal(got, reference(model_dir, rank))
        assert progress.loaded_from == "peer:src-0"
        assert progress.bytes_loaded == progress.bytes_total == loader.last_result.nbytes  # type: ignore[union-attr]
        assert loader.last_result is not None and loader.last_result.batches > 4
        assert int(got["embed.scale"][0]) == rank + 1  # rank r got rank r's shard
    # Source bookkeeping: both reads completed and verified, no session left open.
    health = httpx.get(f"http://{source.address}{P2P_PREFIX}/health").json()
    assert health["completed_reads"] >= 2 and health["active_sessions"] == 0


def test_two_process_transfer_verified_with_dev64(model_dir: Path, tmp_path: Path) -> None:
    """A source publishing dev64 (the kind CUDA sources use by default, here computed by the
    CPU implementation on both sides): the manifest says so and the target verifies it."""
    with source_process(model_dir, tmp_path, pod="dev-0", checksum="dev64") as (_, cand):
        manifest = httpx.get(
            f"http://{cand.address}{P2P_PREFIX}/manifest",
            params={"rank": 1, "identity": "ident-test"},
        ).json()
        assert manifest["checksum_kind"] == "dev64"
        assert all(len(t["checksum"]) == 16 for t in manifest["tensors"])
        got = PeerToPeerLoader(options=FAST).load(
            target_plan(model_dir, [cand]), 1, CPU, LoadProgress()
        )
        assert_bit_equal(got, reference(model_dir, 1))


def test_target_without_files_trusts_manifest_and_verifies(
    model_dir: Path, source: PeerCandidate, tmp_path: Path
) -> None:
    plan = target_plan(tmp_path / "empty", [source])
    got = PeerToPeerLoader(options=FAST).load(plan, 1, CPU, LoadProgress())
    assert_bit_equal(got, reference(model_dir, 1))


def test_source_refuses_other_identity_and_rank(source: PeerCandidate) -> None:
    base = f"http://{source.address}{P2P_PREFIX}/manifest"
    r = httpx.get(base, params={"rank": 0, "identity": "someone-else"})
    assert r.status_code == 409 and r.json()["error"] == "identity_mismatch"
    assert "ident-test" in r.json()["message"]
    r = httpx.get(base, params={"rank": 7, "identity": "ident-test"})
    assert r.status_code == 404 and r.json()["error"] == "unknown_rank"
    r = httpx.get(base, params={"rank": "x", "identity": "ident-test"})
    assert r.status_code == 400
    r = httpx.get(base, params={"rank": 0, "identity": "ident-test"})
    assert r.status_code == 200 and r.json()["rank"] == 0


def test_identity_mismatch_is_load_error(model_dir: Path, source: PeerCandidate) -> None:
    plan = make_plan(model_dir, pod="tgt-0", identity="other-model", peers=[source])
    t0 = time.monotonic()
    with pytest.raises(LoadError, match=r"peer src-0: manifest refused \(409\).*other-model"):
        PeerToPeerLoader(options=FAST).load(plan, 0, CPU, LoadProgress())
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    ("dtype", "hidden_scale", "message"),
    [
        (torch.bfloat16, 1.0, "dtype F16 != expected BF16"),
        (torch.float16, 2.0, "shape"),
    ],
)
def test_shape_or_dtype_mismatch_rejected(
    source: PeerCandidate, tmp_path: Path, dtype: torch.dtype, hidden_scale: float, message: str
) -> None:
    # The target's own files say something else than the source holds.
    mine = tmp_path / "mine"
    write_sharded_model(mine, size_mb=4 * hidden_scale**2, tensor_parallel=2, dtype=dtype)
    plan = target_plan(mine, [source])
    progress = LoadProgress()
    with pytest.raises(LoadError, match="peer src-0") as err:
        PeerToPeerLoader(options=FAST).load(plan, 0, CPU, progress)
    assert message in str(err.value)
    assert progress.loaded_from is None and progress.bytes_loaded == 0


@pytest.mark.parametrize("kind", ["xxh3", "dev64"])
def test_checksum_mismatch_discarded(model_dir: Path, kind: ChecksumSetting) -> None:
    tensors = {r: reference(model_dir, r) for r in (0, 1)}
    src = ThreadSource(make_plan(model_dir, pod="liar-0", checksum=kind), tensors)
    try:
        assert src.publisher.ranks[0].manifest.checksum_kind == kind
        # Change one byte of registered memory after the manifest was computed.
        entry = src.publisher.ranks[0].manifest.tensors[3]
        src.publisher.ranks[0].placed[entry.name].reshape(-1).view(torch.uint8)[7] ^= 0xFF
        plan = target_plan(model_dir, [src.candidate])
        with pytest.raises(LoadError, match=rf"tensor '{entry.name}': {kind} checksum"):
            PeerToPeerLoader(options=FAST).load(plan, 0, CPU, LoadProgress())
        # The other rank is intact and still verifies.
        got = PeerToPeerLoader(options=FAST).load(plan, 1, CPU, LoadProgress())
        assert_bit_equal(got, reference(model_dir, 1))
    finally:
        src.close()


def test_dead_candidate_skipped(model_dir: Path, source: PeerCandidate) -> None:
    dead = PeerCandidate(pod="gone-0", address="127.0.0.1:9")  # discard port: refused
    plan = target_plan(model_dir, [dead, source])
    loader = PeerToPeerLoader(options=FAST)
    progress = LoadProgress()
    got = loader.load(plan, 0, CPU, progress)
    assert_bit_equal(got, reference(model_dir, 0))
    assert progress.loaded_from == "peer:src-0"


def test_killed_source_falls_back_fast(model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the source mid-transfer: LoadError in seconds, no partial data, storage works."""
    with source_process(model_dir, tmp_path, pod="doomed-0") as (proc, cand):
        plan = target_plan(model_dir, [cand])
        killed_at: list[float] = []

        def on_batch(done: int, total: int) -> None:
            if done == 2 and not killed_at:
                proc.kill()
                killed_at.append(time.monotonic())

        opts = PullOptions(**{**FAST.__dict__, "throttle_s": 0.1, "max_in_flight": 2})
        loader = PeerToPeerLoader(options=opts, on_batch=on_batch)
        progress = LoadProgress()
        with pytest.raises(LoadError, match="peer doomed-0") as err:
            loader.load(plan, 0, CPU, progress)
        detected = time.monotonic() - killed_at[0]
        print(f"killed-source detected in {detected:.3f}s: {err.value}")
    assert killed_at, "the transfer finished before the kill; make the model bigger"
    assert detected < 10, f"fallback took {detected:.1f}s: {err.value}"
    assert loader.failures[0].kind in ("dead", "transfer", "stall")
    assert progress.loaded_from is None and progress.bytes_loaded == 0
    assert "doomed-0" in str(err.value)
    # What the worker then does: load from storage (its own storage loader).
    assert_bit_equal(storage_load(plan, 0, CPU), reference(model_dir, 0))


def test_source_serves_next_reader_after_reader_vanished(
    model_dir: Path, source: PeerCandidate, tmp_path: Path
) -> None:
    """A reader killed mid-transfer must not wedge the source (ModelExpress #555)."""
    from tests.support.p2p import Proc

    plan = target_plan(tmp_path / "nofiles", [source], max_in_flight=1)
    path = tmp_path / "reader.json"
    path.write_text(plan.model_dump_json())
    reader = Proc(["pull", "--plan", str(path), "--throttle-s", "0.2"])
    try:
        reader.next_event("batch", timeout=90)
    finally:
        reader.kill()
    t0 = time.monotonic()
    got = PeerToPeerLoader(options=FAST).load(plan, 0, CPU, LoadProgress())
    assert time.monotonic() - t0 < 10
    assert_bit_equal(got, reference(model_dir, 0))
    health = httpx.get(f"http://{source.address}{P2P_PREFIX}/health").json()
    assert health["ok"]


def test_concurrent_readers(model_dir: Path, source: PeerCandidate) -> None:
    plan = target_plan(model_dir, [source])
    results: dict[int, dict[str, torch.Tensor]] = {}

    def pull(rank: int) -> None:
        results[rank] = PeerToPeerLoader(options=FAST).load(plan, rank, CPU, LoadProgress())

    threads = [threading.Thread(target=pull, args=(r,)) for r in (0, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rank in (0, 1):
        assert_bit_equal(results[rank], reference(model_dir, rank))


def test_frozen_source_detected_by_liveness(model_dir: Path, tmp_path: Path) -> None:
    """SIGSTOP the source mid-transfer (alive, unresponsive): dropped within seconds."""
    import os
    import signal

    with source_process(model_dir, tmp_path, pod="frozen-0") as (proc, cand):
        plan = target_plan(model_dir, [cand])
        stopped_at: list[float] = []

        def on_batch(done: int, total: int) -> None:
            if done == 1 and not stopped_at:
                os.kill(proc.p.pid, signal.SIGSTOP)
                stopped_at.append(time.monotonic())

        opts = PullOptions(**{**FAST.__dict__, "throttle_s": 0.5, "max_in_flight": 1})
        loader = PeerToPeerLoader(options=opts, on_batch=on_batch)
        try:
            with pytest.raises(LoadError, match="peer frozen-0") as err:
                loader.load(plan, 0, CPU, LoadProgress())
            detected = time.monotonic() - stopped_at[0]
        finally:
            os.kill(proc.p.pid, signal.SIGCONT)
    assert detected < 10, f"took {detected:.1f}s: {err.value}"
    assert loader.failures[0].kind in ("dead", "stall")
    assert "liveness" in str(err.value) or "no READ completed" in str(err.value)


def test_publisher_routes_and_sessions(model_dir: Path) -> None:
    tensors = {0: reference(model_dir, 0)}
    src = ThreadSource(make_plan(model_dir, pod="routes-0", ranks=[0]), tensors)
    base = f"http://{src.candidate.address}{P2P_PREFIX}"
    try:
        # load_file gives one storage per tensor: few enough to register in place, no copy.
        rank0 = src.publisher.ranks[0]
        assert len(rank0.manifest.regions) == len(tensors[0])
        assert all(rank0.placed[n].data_ptr() == t.data_ptr() for n, t in tensors[0].items())
        # A checkpoint's tensors: no layout named, the manifest as older targets parse it.
        assert b'"layout"' not in rank0.manifest_body
        r = httpx.post(
            f"{base}/sessions", json={"identity": "ident-test", "rank": 0, "reader": "r1"}
        )
        assert r.status_code == 201
        sid = r.json()["session"]
        assert httpx.get(f"{base}/health").json()["active_sessions"] == 1
        r = httpx.request("DELETE", f"{base}/sessions/{sid}", json={"verified": False})
        assert r.status_code == 200
        health = httpx.get(f"{base}/health").json()
        assert health["active_sessions"] == 0 and health["failed_reads"] == 1
        assert httpx.request("DELETE", f"{base}/sessions/{sid}").status_code == 404
        r = httpx.post(f"{base}/sessions", json={"identity": "x", "rank": 0})
        assert r.status_code == 409
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        src.close()
    # Closed publisher answers 503.
    assert src.publisher._closed


def test_publisher_packs_many_small_tensors(model_dir: Path) -> None:
    many = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(40)}  # 40 storages > 16
    src = ThreadSource(make_plan(model_dir, pod="packed-0", ranks=[0]), {0: many})
    try:
        assert len(src.publisher.ranks[0].manifest.regions) == 1
        plan = target_plan(model_dir / "none", [src.candidate], ranks=[0])
        got = PeerToPeerLoader(options=FAST).load(plan, 0, CPU, LoadProgress())
        assert_bit_equal(got, many)
    finally:
        src.close()
