"""hf:// through huggingface_hub against a loopback server that speaks the Hub's download API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.storage import make_model, plan_for
from weightlift.local.hubserver import HubRepo, HubServer
from weightlift.worker.storage.errors import StorageError
from weightlift.worker.storage.fetch import materialize
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
