"""hf:// (huggingface_hub's API, then ranged GETs) against a loopback server of the Hub API."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.storage import make_model, plan_for
from weightlift.local.hubserver import HubRepo, HubServer
from weightlift.worker.storage import hf
from weightlift.worker.storage.errors import StorageError
from weightlift.worker.storage.fetch import materialize
from weightlift.worker.storage.hfread import HubObject, HubReader
from weightlift.worker.weights.progress import LoadProgress

TOKEN = "hf_test_token_5b2e9c"
REPO = "acme/tiny"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], Path]:
    root = tmp_path_factory.mktemp("hub")
    model = make_model(root / "v1", files=2, mb=2.0)
    (root / "v1" / "pytorch_model.bin").write_bytes(b"not wanted")  # other formats are skipped
    return model, root


@pytest.fixture(scope="module")
def hub(files: tuple[dict[str, bytes], Path]) -> Iterator[tuple[HubServer, str]]:
    _, root = files
    repo = HubRepo()
    sha = repo.add_commit(root / "v1", ref="main")
    bare = root / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    empty = HubRepo()
    empty.add_commit(bare)
    with HubServer({REPO: repo, "acme/no-weights": empty}, token=TOKEN) as server:
        yield server, sha


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


def test_snapshot_at_a_branch_and_at_a_pinned_commit(
    hub: tuple[HubServer, str], files: tuple[dict[str, bytes], Path], token: None, tmp_path: Path
) -> None:
    server, sha = hub
    model, _ = files
    progress = LoadProgress()
    fetched = materialize(
        plan_for(f"hf://{REPO}", tmp_path / "a", endpoint=server.endpoint), progress
    )
    assert fetched.loaded_from == "storage:hf"
    got = {p.name: p.read_bytes() for p in Path(fetched.model_dir).iterdir() if p.is_file()}
    assert got == model  # pytorch_model.bin skipped
    assert progress.bytes_loaded == progress.bytes_total == sum(len(b) for b in model.values())
    pinned = materialize(
        plan_for(f"hf://{REPO}@{sha}", tmp_path / "b", endpoint=server.endpoint), LoadProgress()
    )
    assert sorted(p.name for p in Path(pinned.model_dir).iterdir() if p.is_file()) == sorted(model)


def test_bad_revision(hub: tuple[HubServer, str], token: None, tmp_path: Path) -> None:
    server, _ = hub
    with pytest.raises(
        StorageError, match=r"hf://acme/tiny@v9: revision 'v9' does not exist in acme/tiny"
    ):
        materialize(plan_for(f"hf://{REPO}@v9", tmp_path, endpoint=server.endpoint), LoadProgress())


def test_wrong_token_is_not_echoed(
    hub: tuple[HubServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = hub
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_0000")
    with pytest.raises(StorageError) as err:
        materialize(plan_for(f"hf://{REPO}", tmp_path, endpoint=server.endpoint), LoadProgress())
    assert "repository not found, or private" in str(err.value)
    assert "hf_wrong_token_0000" not in str(err.value)


def test_repo_without_safetensors(hub: tuple[HubServer, str], token: None, tmp_path: Path) -> None:
    server, _ = hub
    with pytest.raises(
        StorageError,
        match=r"hf://acme/no-weights@main: no .safetensors files at commit \w+ \(config.json\)",
    ):
        materialize(
            plan_for("hf://acme/no-weights", tmp_path, endpoint=server.endpoint), LoadProgress()
        )


def test_hf_endpoint_env_is_honoured(
    hub: tuple[HubServer, str], token: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = hub
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    fetched = materialize(plan_for(f"hf://{REPO}", tmp_path), LoadProgress())
    assert (Path(fetched.model_dir) / "model-00001-of-00002.safetensors").is_file()


# The ranged reader (worker/storage/hfread.py), each case on its own server and copy of the repo
# so that damaging a file there leaves the module's repo alone.


@pytest.fixture
def own_hub(tmp_path: Path) -> Iterator[tuple[HubServer, dict[str, bytes], Path]]:
    model = make_model(tmp_path / "repo", files=2, mb=2.0, seed=3)
    repo = HubRepo()
    repo.add_commit(tmp_path / "repo", ref="main")
    with HubServer({REPO: repo}, token=TOKEN) as server:
        yield server, model, tmp_path / "repo"


def _snap(server: HubServer) -> hf.HubSnapshot:
    return hf.resolve(REPO, "main", endpoint=server.endpoint, token=TOKEN)


def test_many_small_ranges_rebuild_every_file_and_count_every_byte(
    own_hub: tuple[HubServer, dict[str, bytes], Path], tmp_path: Path
) -> None:
    server, model, _ = own_hub
    seen: list[int] = []
    paths = hf.fetch(
        _snap(server),
        tmp_path / "out",
        seen.append,
        endpoint=server.endpoint,
        token=TOKEN,
        threads=4,
        chunk_bytes=64 << 10,  # 2 MiB files: 32 ranges each, interleaved across threads
    )
    assert {p.name: p.read_bytes() for p in paths} == model
    assert sum(seen) == sum(len(b) for b in model.values()) and len(seen) > 64
    assert not (tmp_path / "out" / ".cache").exists()  # no huggingface_hub metadata beside them


def test_file_removed_after_listing_is_named(
    own_hub: tuple[HubServer, dict[str, bytes], Path], tmp_path: Path
) -> None:
    server, _, root = own_hub
    snap = _snap(server)
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(StorageError) as err:
        hf.fetch(snap, tmp_path / "out", lambda _n: None, endpoint=server.endpoint, token=TOKEN)
    assert str(err.value) == (
        f"hf://{REPO}@{snap.commit}/model-00002-of-00002.safetensors: file not found at this commit"
    )
    assert err.value.permanent


def test_truncated_transfer_names_file_and_offset(
    own_hub: tuple[HubServer, dict[str, bytes], Path],
) -> None:
    server, model, root = own_hub
    snap = _snap(server)
    reader = HubReader(REPO, snap.commit, endpoint=server.endpoint, token=TOKEN)
    name = "model-00001-of-00002.safetensors"
    (obj,) = reader.locate([f for f in snap.files if f.name == name])
    os.truncate(root / name, obj.size // 2)  # the server now ends the body half-way
    got = bytearray(obj.size)

    def sink(piece: memoryview, offset: int) -> None:
        got[offset : offset + len(piece)] = piece

    with pytest.raises(StorageError, match=rf"hf://{REPO}@{snap.commit}/{name}: truncated") as err:
        reader.read_range(obj, 0, obj.size, sink)
    arrived = re.search(rf"got (\d+) of {obj.size} bytes at offset 0", str(err.value))
    assert arrived is not None and not err.value.permanent
    k = int(arrived[1])
    assert k < obj.size // 2 + 1 and bytes(got[:k]) == model[name][:k]


def test_size_or_sha256_unlike_the_listing_is_refused(
    own_hub: tuple[HubServer, dict[str, bytes], Path],
) -> None:
    server, _, _ = own_hub
    snap = _snap(server)
    reader = HubReader(REPO, snap.commit, endpoint=server.endpoint, token=TOKEN)
    f = snap.files[0]
    assert f.sha256  # the local Hub lists an LFS sha256, as the Hub does for weights
    with pytest.raises(StorageError, match=rf"/{f.name}: the Hub serves {f.size} bytes, it lists"):
        reader.locate([hf.HubFile(f.name, f.size + 1, f.sha256)])
    with pytest.raises(StorageError, match=rf"/{f.name}: the Hub's ETag \w+ is not the listed"):
        reader.locate([hf.HubFile(f.name, f.size, "0" * 64)])


def test_token_goes_to_the_hub_host_only(
    own_hub: tuple[HubServer, dict[str, bytes], Path], tmp_path: Path
) -> None:
    server, _, root = own_hub
    snap = _snap(server)
    reader = HubReader(REPO, snap.commit, endpoint=server.endpoint, token=TOKEN)
    (obj,) = reader.locate(snap.files[:1])
    assert obj.hub_host
    # The same bytes on another host (as a CDN the Hub redirects to) that also wants the token:
    # the reader must not send it there, so that host refuses.
    other = HubRepo()
    other.commits[snap.commit] = root
    with HubServer({REPO: other}, token=TOKEN) as cdn:
        elsewhere = HubObject(
            obj.name, obj.size, obj.url.replace(server.endpoint, cdn.endpoint), False
        )
        with pytest.raises(StorageError, match=r"access denied|repository not found") as err:
            reader.read_range(elsewhere, 0, obj.size, lambda _p, _o: None)
    assert TOKEN not in str(err.value)


def test_wrong_token_on_a_range_is_not_echoed(
    own_hub: tuple[HubServer, dict[str, bytes], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _, _ = own_hub
    snap = _snap(server)
    (obj,) = HubReader(REPO, snap.commit, endpoint=server.endpoint, token=TOKEN).locate(
        snap.files[:1]
    )
    wrong = "hf_wrong_token_1111"
    monkeypatch.setenv("HF_TOKEN", wrong)
    reader = HubReader(REPO, snap.commit, endpoint=server.endpoint, token=wrong)
    with pytest.raises(StorageError, match="repository not found, or private") as err:
        reader.read_range(obj, 0, obj.size, lambda _p, _o: None)
    assert wrong not in str(err.value) and err.value.permanent
