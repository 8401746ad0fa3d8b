"""Identical weights give bit-identical outputs whatever loaded them: preload (mapped and
staged), direct, P2P from a source that loaded by preload, and copies in fresh memory that the
runtime places before binding.

The model's files are rewritten so their data section starts off a 64-byte boundary (8 or 40
bytes past one), as most safetensors files do (headers are padded to 8 bytes only). Every path
puts each tensor at its file offset mod 64 (the canonical placement, weights/tensors.py): the
mapped load in place, with no byte copied; fresh buffers (staged reads, the P2P target, the
copies) at that residue. Before all paths agreed on one placement, batch-1 outputs of the
mapped source and the P2P target differed in the last bits (MKL's gemv picks its code path by
the weights' alignment).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.p2p import ThreadSource, needs_nixl
from tests.support.worker import pad_header
from weightlift.api.model import Role
from weightlift.bench.load import copied_bytes
from weightlift.local.models import DemoModel, make_demo
from weightlift.local.sharded import make_plan
from weightlift.worker.engines.builtin.runtime import Pt2Runtime
from weightlift.worker.loaders.direct import DirectLoader
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.progress import LoadProgress
from weightlift.worker.weights.tensors import TENSOR_ALIGNMENT, file_residues, misplaced

CPU = torch.device("cpu")
Shards = dict[int, dict[str, torch.Tensor]]


@pytest.fixture(scope="module", params=[(1, 8), (2, 40)], ids=["tp1-r8", "tp2-r40"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DemoModel:
    tp, residue = request.param
    demo = make_demo(tmp_path_factory.mktemp(f"ident-tp{tp}"), size_mb=3, tp=tp, hook=False)
    for f in demo.files:
        pad_header(f, residue)
    return demo


def residues(demo: DemoModel, rank: int) -> dict[str, int]:
    infos = (info for _, info in shard_index(demo.out, rank, demo.tp).tensors.values())
    return file_residues(infos, CPU)


def storage_loads(demo: DemoModel) -> dict[str, Callable[[int], dict[str, torch.Tensor]]]:
    def index(rank: int):  # type: ignore[no-untyped-def]
        return shard_index(demo.out, rank, demo.tp)

    return {
        "preload": lambda r: PreloadLoader().load_index(index(r), CPU, LoadProgress()),
        "preload-staged": lambda r: PreloadLoader(staged=True).load_index(
            index(r), CPU, LoadProgress()
        ),
        "direct": lambda r: DirectLoader().load_index(index(r), CPU, LoadProgress()),
    }


def outputs(demo: DemoModel, shards: Shards, inputs: list[np.ndarray]) -> list[bytes]:
    runtime = Pt2Runtime.open(demo.out)
    bound = runtime.bind(shards)
    for r, tensors in bound.items():  # the runtime placed whatever was not yet placed
        assert not misplaced(tensors, residues(demo, r)), r
    return [runtime.infer({"INPUT0": x})["OUTPUT0"].tobytes() for x in inputs]


def test_files_really_are_misaligned(model: DemoModel) -> None:
    """The precondition that makes the comparison below mean something."""
    for r in range(model.tp):
        offsets = {
            info.begin % TENSOR_ALIGNMENT
            for _, info in shard_index(model.out, r, model.tp).tensors.values()
        }
        assert offsets != {0}, offsets


@needs_nixl
@pytest.mark.timeout(180)
def test_every_load_path_gives_bit_identical_outputs(model: DemoModel, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    d_model = json.loads((model.out / "model.json").read_text())["inputs"][0]["shape"][1]
    inputs = [torch.randn(b, d_model, generator=gen).numpy() for b in (1, 1, 2, 3, 8, 33)]

    shards: dict[str, Shards] = {
        name: {r: load(r) for r in range(model.tp)} for name, load in storage_loads(model).items()
    }
    # The source loaded by preload and publishes what it serves; a target pulls it over NIXL.
    src_plan = make_plan(model.out, pod="ident-src", tensor_parallel=model.tp)
    source = ThreadSource(src_plan, shards["preload"])
    try:
        tgt_plan = make_plan(
            model.out,
            pod="ident-tgt",
            tensor_parallel=model.tp,
            role=Role.TARGET,
            peers=[source.candidate],
        )
        loader = PeerToPeerLoader()
        shards["p2p"] = {r: loader.load(tgt_plan, r, CPU, LoadProgress()) for r in range(model.tp)}
        assert loader.last_result is not None
    finally:
        source.close()

    for name, by_rank in shards.items():
        for r, tensors in by_rank.items():
            bad = misplaced(tensors, residues(model, r))
            assert not bad, f"{name} rank {r}: tensors off their file offsets mod 64: {bad[:3]}"
    for r, tensors in shards["preload"].items():  # zero copy: every tensor views its file
        assert copied_bytes(tensors, model.files) == 0, r
    # Copies in fresh (64-byte aligned) memory: the runtime must place them before binding.
    shards["copied"] = {
        r: {k: t.clone() for k, t in tensors.items()} for r, tensors in shards["direct"].items()
    }
    assert all(misplaced(shards["copied"][r], residues(model, r)) for r in range(model.tp))

    results = {name: outputs(model, s, inputs) for name, s in shards.items()}
    want = results["p2p"]
    for name, got in results.items():
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            ta = torch.frombuffer(bytearray(a), dtype=torch.uint8)
            tb = torch.frombuffer(bytearray(b), dtype=torch.uint8)
            assert torch.equal(ta, tb), (
                f"{name} vs p2p differ for input {i} (batch {inputs[i].shape[0]})"
            )
