"""Preload and Direct loaders: bit-equal to safetensors.load_file; files per rank; Auto choice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.worker import make_plan
from weightlift.local.models import DemoModel
from weightlift.worker.loaders.direct import DirectLoader
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.loaders.strategy import (
    choose_storage_loader,
    load_from_peers,
    wants_peer_to_peer,
)
from weightlift.worker.weights.files import index_files, rank_files
from weightlift.worker.weights.header import SAFETENSORS_DTYPES, SafetensorsFormatError
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import TORCH_DTYPES, all_bit_equal, bit_equal

CPU = torch.device("cpu")


def reference(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize(
    "loader", [PreloadLoader(threads=3, chunk_mib=1), DirectLoader()], ids=["preload", "direct"]
)
@pytest.mark.parametrize("model", ["demo_tp1", "demo_tp2"])
def test_loader_bit_equal_to_load_file(
    loader: PreloadLoader | DirectLoader, model: str, request: pytest.FixtureRequest
) -> None:
    demo: DemoModel = request.getfixturevalue(model)
    plan = make_plan(demo.out, tp=demo.tp)
    total = 0
    for r in range(demo.tp):
        files = rank_files(demo.out, r, demo.tp)
        progress = LoadProgress()
        got = loader.load(plan, r, CPU, progress)
        ref = reference(files)
        assert len(ref) == 3 * demo.num_layers
        assert all_bit_equal(got, ref)
        assert (
            progress.bytes_loaded
            == progress.bytes_total
            == sum(t.numel() * t.element_size() for t in ref.values())
        )
        assert progress.finished is not None and progress.gbps > 0
        total += progress.bytes_total
    assert total == demo.bytes_total


def test_rank_reads_only_its_files(demo_tp2: DemoModel) -> None:
    r0 = [p.name for p in rank_files(demo_tp2.out, 0, 2)]
    r1 = [p.name for p in rank_files(demo_tp2.out, 1, 2)]
    assert r0 == ["rank-0-of-2-00001.safetensors", "rank-0-of-2-00002.safetensors"]
    assert r1 == ["rank-1-of-2-00001.safetensors", "rank-1-of-2-00002.safetensors"]
    got = PreloadLoader().load(make_plan(demo_tp2.out, tp=2), 1, CPU, LoadProgress())
    # rank 1 holds the second half of each up-projection: shape [d_ff/2, d_model]
    assert got["layers.0.up.weight"].shape == (demo_tp2.d_ff // 2, demo_tp2.d_model)
    assert all_bit_equal(got, reference([demo_tp2.out / n for n in r1]))


def test_every_dtype_and_misaligned_offsets(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for i, (code, dt) in enumerate(TORCH_DTYPES.items()):
        # odd element counts make later tensors start at offsets unaligned to their itemsize
        n = 3 + 2 * i
        raw = torch.randint(
            0, 255, (n * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8, generator=g
        )
        t = raw.view(dt) if dt != torch.bool else (raw % 2).bool()
        tensors[f"t{i:02d}_{code}"] = t.reshape(n) if i % 2 else t.reshape(1, n)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4)
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p))
    ref = load_file(str(p))
    plan = make_plan(tmp_path)
    for loader in (PreloadLoader(threads=2, chunk_mib=1), DirectLoader()):
        got = loader.load(plan, 0, CPU, LoadProgress())
        assert got.keys() == ref.keys()
        for k in ref:
            assert bit_equal(got[k], ref[k]), (loader.name, k)


def test_preload_many_chunks_and_files(tmp_path: Path) -> None:
    """Chunks smaller than tensors, tensors spanning chunk boundaries, several files."""
    g = torch.Generator().manual_seed(3)
    for i in range(3):
        save_file(
            {f"f{i}.w{j}": torch.randn(257, 129, generator=g) for j in range(4)},
            str(tmp_path / f"model-{i + 1:05d}-of-00003.safetensors"),
        )
    files = rank_files(tmp_path, 0, 1)
    idx = index_files(files)
    progress = LoadProgress()
    got = PreloadLoader().load_index(idx, CPU, progress, threads=4, chunk_bytes=12345)
    assert all_bit_equal(got, reference(files))
    assert progress.bytes_loaded == idx.data_bytes


def test_preload_tensors_are_views_of_one_buffer(demo_tp1: DemoModel) -> None:
    got = PreloadLoader().load(make_plan(demo_tp1.out), 0, CPU, LoadProgress())
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1  # zero per-tensor copies: one shared host buffer


def test_loaders_reject_bad_files_before_loading(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(100), "b": torch.randn(100)}, str(p))
    data = p.read_bytes()
    p.write_bytes(data[:-50])
    plan = make_plan(tmp_path)
    for loader in (PreloadLoader(), DirectLoader()):
        with pytest.raises(SafetensorsFormatError, match=r"model\.safetensors: tensor 'b'"):
            loader.load(plan, 0, CPU, LoadProgress())


def test_rank_files_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no safetensors files"):
        rank_files(tmp_path, 0, 1)
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model-00001-of-00003.safetensors"))
    with pytest.raises(LoadError, match=r"missing shard files \['model-00002-of-00003"):
        rank_files(tmp_path, 0, 1)
    with pytest.raises(LoadError, match="no presharded files rank-1-of-2"):
        rank_files(tmp_path, 1, 2)
    with pytest.raises(LoadError, match="outside tensor-parallel size"):
        rank_files(tmp_path, 2, 2)


def test_auto_chooses_by_host_memory(demo_tp2: DemoModel) -> None:
    plan = make_plan(demo_tp2.out, tp=2)
    devs = {0: CPU, 1: CPU}
    assert choose_storage_loader(plan, devs, available=10 * demo_tp2.bytes_total).name == "preload"
    assert choose_storage_loader(plan, devs, available=demo_tp2.bytes_total).name == "direct"
    forced = make_plan(demo_tp2.out, tp=2, loading={"strategy": "Preload"})
    assert choose_storage_loader(forced, devs, available=0).name == "preload"
    direct = make_plan(demo_tp2.out, tp=2, loading={"strategy": "Direct"})
    assert choose_storage_loader(direct, devs, available=1 << 40).name == "direct"


def test_one_place_picks_peer_to_peer(demo_tp2: DemoModel) -> None:
    peers = [{"pod": "src-0", "address": "127.0.0.1:9"}]
    assert wants_peer_to_peer(make_plan(demo_tp2.out, tp=2, role="Target", peers=peers))
    assert not wants_peer_to_peer(make_plan(demo_tp2.out, tp=2, role="Target"))  # no peers
    assert not wants_peer_to_peer(make_plan(demo_tp2.out, tp=2, role="Source", peers=peers))
    for strategy in ("Preload", "Direct"):
        forced = make_plan(
            demo_tp2.out, tp=2, role="Target", peers=peers, loading={"strategy": strategy}
        )
        assert not wants_peer_to_peer(forced)


def test_no_peer_delivers_so_storage_loads_the_same_tensors(demo_tp2: DemoModel) -> None:
    """A Target whose only peer is unreachable gets None from the peers (progress reset) and
    then rank 1's exact tensors from the storage loader the plan chooses."""
    peers = [{"pod": "gone-0", "address": "127.0.0.1:9"}]
    plan = make_plan(
        demo_tp2.out,
        tp=2,
        role="Target",
        peers=peers,
        loading={"peerToPeer": {"transferTimeoutSeconds": 2}},
    )
    progress = LoadProgress()
    assert load_from_peers(plan, 1, CPU, progress) is None
    assert progress.loaded_from is None and progress.bytes_loaded == 0
    loader = choose_storage_loader(plan, {0: CPU, 1: CPU})
    tensors = loader.load(plan, 1, CPU, progress)
    assert all_bit_equal(tensors, reference(rank_files(demo_tp2.out, 1, 2)))
    # A Source never asks a peer, whatever candidates it has.
    source = make_plan(demo_tp2.out, tp=2, role="Source", peers=peers)
    assert load_from_peers(source, 0, CPU, LoadProgress()) is None


def test_one_dtype_table_agrees_with_torch() -> None:
    """header.py's table is the only one: every name maps to a torch dtype of that size."""
    assert set(TORCH_DTYPES) == set(SAFETENSORS_DTYPES)
    for name, (_, size) in SAFETENSORS_DTYPES.items():
        assert torch.empty((), dtype=TORCH_DTYPES[name]).element_size() == size, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned + H2D)")
def test_preload_cuda_pinned(demo_tp1: DemoModel) -> None:  # pragma: no cover - GPU only
    dev = torch.device("cuda", 0)
    got = PreloadLoader(pinned=True).load(make_plan(demo_tp1.out), 0, dev, LoadProgress())
    assert all(t.device == dev for t in got.values())
    assert all_bit_equal(got, reference(rank_files(demo_tp1.out, 0, 1)))
    direct = DirectLoader().load(make_plan(demo_tp1.out), 0, dev, LoadProgress())
    assert all_bit_equal(direct, got)


def test_preload_file_shrinks_during_read(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(1000)}, str(p))
    idx = index_files([p])
    os.truncate(p, p.stat().st_size - 100)  # shrinks after the header was validated
    with pytest.raises(LoadError, match="truncated while reading"):
        PreloadLoader().load_index(idx, CPU, LoadProgress())
