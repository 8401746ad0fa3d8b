"""s3:// against a real MinIO on loopback: the download, its progress, the cache, and bad input."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.storage import make_model, minio, plan_for
from weightlift.api.model import Engine, ModelFormat, ModelSource, Role, RuntimeSpec
from weightlift.api.worker import PeerCandidate, WorkerPlan
from weightlift.local.s3server import MinioServer
from weightlift.worker.engines.vllm import weights as vllm_weights
from weightlift.worker.engines.vllm.ranks import (
    ModelDirError,
    check_model_dir,
    holds_weights,
)
from weightlift.worker.engines.vllm.weights import (
    RankLoad,
    load_rank,
)
from weightlift.worker.storage.errors import StorageError
from weightlift.worker.storage.fetch import Fetched, materialize
from weightlift.worker.storage.s3 import S3Store
from weightlift.worker.weights.progress import LoadProgress

BUCKET = "models"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    yield from minio(tmp_path_factory.mktemp("s3"))


@pytest.fixture(scope="module")
def model(s3: MinioServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    files = make_model(tmp_path_factory.mktemp("model"), files=3, mb=3.0)
    src = tmp_path_factory.getbasetemp() / "upload"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    s3.upload_dir(src, BUCKET, "tiny")
    return files


@pytest.fixture
def creds(s3: MinioServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


class Recorder(LoadProgress):
    """Keeps every value bytes_loaded passed through: progress must grow during the download."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def add(self, nbytes: int) -> None:
        super().add(nbytes)
        self.seen.append(self.bytes_loaded)


def _same_files(directory: Path, expected: dict[str, bytes]) -> None:
    got = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    assert got == expected


def test_download_matches_the_objects_and_progress_grows(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    progress = Recorder()
    fetched = materialize(plan_for(f"s3://{BUCKET}/tiny", tmp_path, endpoint=s3.endpoint), progress)
    assert fetched.loaded_from == "storage:s3"
    _same_files(Path(fetched.model_dir), model)
    total = sum(len(b) for b in model.values())
    assert progress.bytes_total == total and progress.bytes_loaded == total
    # 9 MB in 16 MiB ranges is one range per file: at least one value below the total per file.
    assert len([v for v in progress.seen if v < total]) >= len(model) - 1


def test_small_ranges_on_one_thread_rebuild_the_files_over_one_kept_connection(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    """Bodies are read from the socket past urllib3 (ranged.socket_readinto): every byte still
    arrives, and each connection goes back to the pool once its body is read to the end."""
    store = S3Store(BUCKET, "tiny", endpoint=s3.endpoint, threads=1, chunk_bytes=256 << 10)
    objs = store.list_objects()
    seen: list[int] = []
    paths = store.fetch(objs, tmp_path / "out", seen.append)
    assert {p.name: p.read_bytes() for p in paths} == model
    assert len(seen) > 3 * 12  # 3 MB files in 256 KiB ranges
    pools = store.client._endpoint.http_session._manager.pools
    # urllib3's RecentlyUsedContainer has keys() but refuses plain iteration
    made = [pools[key].num_connections for key in pools.keys()]  # noqa: SIM118
    assert made == [1], f"connections opened per pool: {made} (keep-alive lost)"


def test_target_fetches_only_the_small_files(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    from weightlift.worker.storage.fetch import materialize as m

    fetched = m(
        plan_for(f"s3://{BUCKET}/tiny", tmp_path, endpoint=s3.endpoint),
        LoadProgress(),
        weights=False,
    )
    assert sorted(p.name for p in Path(fetched.model_dir).iterdir()) == ["model.json"]


def test_wrong_secret_names_the_object_and_not_the_secret(
    s3: MinioServer, model: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-8c1d")
    with pytest.raises(StorageError) as err:
        materialize(plan_for(f"s3://{BUCKET}/tiny", tmp_path, endpoint=s3.endpoint), LoadProgress())
    msg = str(err.value)
    assert f"s3://{BUCKET}/tiny" in msg and "secret key" in msg, msg
    assert "not-the-secret-8c1d" not in msg


def test_unknown_access_key(
    s3: MinioServer, model: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-knows-me")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "whatever-1234")
    with pytest.raises(StorageError, match=r"access key .* not known"):
        materialize(plan_for(f"s3://{BUCKET}/tiny", tmp_path, endpoint=s3.endpoint), LoadProgress())


def test_missing_bucket(s3: MinioServer, creds: None, tmp_path: Path) -> None:
    with pytest.raises(
        StorageError, match=r"s3://no-such-bucket/tiny: listing failed: bucket does not exist"
    ):
        materialize(
            plan_for("s3://no-such-bucket/tiny", tmp_path, endpoint=s3.endpoint), LoadProgress()
        )


def test_prefix_without_safetensors(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    with pytest.raises(StorageError, match=r"s3://models/nothing-here/: no \.safetensors objects"):
        materialize(
            plan_for(f"s3://{BUCKET}/nothing-here", tmp_path, endpoint=s3.endpoint), LoadProgress()
        )
    s3.client().put_object(Bucket=BUCKET, Key="only-config/config.json", Body=b"{}")  # type: ignore[attr-defined]
    with pytest.raises(
        StorageError, match=r"no \.safetensors objects under the prefix \(found config.json\)"
    ):
        materialize(
            plan_for(f"s3://{BUCKET}/only-config", tmp_path, endpoint=s3.endpoint), LoadProgress()
        )


def test_truncated_object_is_named(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    name = "model-00001-of-00003.safetensors"
    cut = model[name][: len(model[name]) - 1000]
    s3.client().put_object(Bucket=BUCKET, Key=f"cut/{name}", Body=cut)  # type: ignore[attr-defined]
    with pytest.raises(StorageError, match=rf"s3://models/cut/{name}.*beyond the data section"):
        materialize(plan_for(f"s3://{BUCKET}/cut", tmp_path, endpoint=s3.endpoint), LoadProgress())


def test_cache_hit_verify_and_digest_mismatch(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    plan = plan_for(f"s3://{BUCKET}/tiny", tmp_path / "scratch", endpoint=s3.endpoint, cache=cache)
    first = materialize(plan, LoadProgress())
    assert first.loaded_from == "storage:s3"
    second = materialize(plan, LoadProgress())
    assert second.loaded_from == "cache" and second.model_dir == first.model_dir
    _same_files(Path(second.model_dir), model)
    # Flip one byte inside the tensor data: same size, different digest.
    victim = Path(first.model_dir) / "model-00002-of-00003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    third = materialize(plan, LoadProgress())
    assert third.loaded_from == "storage:s3", "a mismatched cache entry must not be used"
    assert any("model-00002-of-00003.safetensors digest" in w for w in third.warnings), (
        third.warnings
    )
    _same_files(Path(third.model_dir), model)


def test_concurrent_replicas_on_one_node_download_once(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    results: list[str] = []

    def one(i: int) -> None:
        plan = plan_for(
            f"s3://{BUCKET}/tiny", tmp_path / f"scratch{i}", endpoint=s3.endpoint, cache=cache
        )
        results.append(materialize(plan, LoadProgress()).loaded_from)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["cache", "cache", "storage:s3"]


def test_lru_eviction_keeps_the_cache_under_its_cap(
    s3: MinioServer, model: dict[str, bytes], creds: None, tmp_path: Path
) -> None:
    from weightlift.worker.storage.cache import NodeCache

    cache = tmp_path / "cache"
    for ident in ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"):
        plan = plan_for(
            f"s3://{BUCKET}/tiny",
            tmp_path / ident,
            endpoint=s3.endpoint,
            cache=cache,
            identity=ident,
        )
        materialize(plan, LoadProgress())
    total = sum(len(b) for b in model.values())
    # A cap of one entry: inserting a third evicts the least recently used (a, then b is newer).
    dropped = NodeCache(cache, total + 10).evict(keep="bbbbbbbbbbbbbbbb")
    assert dropped == ["aaaaaaaaaaaaaaaa"]
    assert not (cache / "aaaaaaaaaaaaaaaa" / "manifest.json").exists()
    assert (cache / "bbbbbbbbbbbbbbbb" / "manifest.json").exists()


def test_vllm_target_ranks_download_the_weights_once_when_the_peer_is_dead(
    s3: MinioServer, creds: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM Target of an s3:// model starts with the small files only (the worker's fetch);
    when its peer fails, each rank's process falls back to storage: the weights are downloaded
    once for the pod and every rank gets its own rows through vLLM's load_weights stand-in."""
    hf = tmp_path / "hf"
    hf.mkdir()
    ckpt = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    save_file(ckpt, str(hf / "model.safetensors"))
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    s3.upload_dir(hf, BUCKET, "llm")
    pod_dir = tmp_path / "pod"
    plan = WorkerPlan(
        deployment="llm",
        pod_name="llm-1",
        model_identity="llm-s3",
        model=ModelSource(
            uri=f"s3://{BUCKET}/llm", endpoint=s3.endpoint, format=ModelFormat.SAFETENSORS
        ),
        model_dir=str(pod_dir),
        served_model_name="llm",
        tensor_parallel=2,
        ranks=[0, 1],
        role=Role.TARGET,
        peers=[PeerCandidate(pod="llm-gone", address="127.0.0.1:9")],
        runtime=RuntimeSpec(engine=Engine.VLLM),
    )
    materialize(plan, LoadProgress(), weights=False)  # what the worker fetched before vLLM
    assert not holds_weights(plan)
    check_model_dir(pod_dir, weights=False)
    with pytest.raises(ModelDirError, match=r"no \*.safetensors"):
        check_model_dir(pod_dir)

    def rank(r: int) -> tuple[RankLoad, dict[str, torch.Tensor]]:
        params = {"w": torch.zeros(4, 8), "b": torch.zeros(8)}

        def feed(tensors: dict[str, torch.Tensor]) -> None:
            params["w"].copy_(tensors["w"][4 * r : 4 * (r + 1)])
            params["b"].copy_(tensors["b"])

        return load_rank(plan, r, params, feed), params

    downloads: list[bool] = []

    def counted(plan: WorkerPlan, progress: LoadProgress, *, weights: bool = True) -> Fetched:
        downloads.append(weights)
        return materialize(plan, progress, weights=weights)

    monkeypatch.setattr(vllm_weights, "materialize", counted)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, [0, 1]))
    for r, (loaded, params) in enumerate(results):
        assert loaded.progress.loaded_from == "storage:s3", loaded
        assert loaded.peer_failures and "llm-gone" in loaded.peer_failures[0]
        assert torch.equal(params["w"], ckpt["w"][4 * r : 4 * (r + 1)])
        assert torch.equal(loaded.published["w"], params["w"])
    # One download for the pod: the rank that came second found the file the first wrote.
    assert downloads == [True]
    assert sorted(p.name for p in pod_dir.glob("*.safetensors")) == ["model.safetensors"]
