"""The PT2 runtime: program without weights, weights bound from the loaded files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.support.worker import copy_model, make_plan
from weightlift.local.models import DemoModel
from weightlift.worker.engines.builtin.runtime import BindError, InferError, Pt2Runtime
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.weights.files import rank_files
from weightlift.worker.weights.progress import LoadProgress


def load_ranks(demo: DemoModel, root: Path | None = None) -> dict[int, dict[str, torch.Tensor]]:
    d = root or demo.out
    plan = make_plan(d, tp=demo.tp)
    return {
        r: PreloadLoader().load(plan, r, torch.device("cpu"), LoadProgress())
        for r in range(demo.tp)
    }


def reference_forward(demo: DemoModel, x: torch.Tensor) -> torch.Tensor:
    """The demo model written with plain torch ops from safetensors' own load_file."""
    full: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(demo.tp):
        full[r] = {}
        for f in rank_files(demo.out, r, demo.tp):
            full[r].update(load_file(str(f)))
    for i in range(demo.num_layers):
        acc = torch.zeros_like(x)
        for r in range(demo.tp):
            w = full[r]
            h = torch.nn.functional.gelu(
                x @ w[f"layers.{i}.up.weight"].T + w[f"layers.{i}.up.bias"]
            )
            acc = acc + h @ w[f"layers.{i}.down.weight"].T
        x = x + acc
    return x


@pytest.mark.parametrize("model", ["demo_tp1", "demo_tp2"])
def test_served_output_matches_reference(model: str, request: pytest.FixtureRequest) -> None:
    demo: DemoModel = request.getfixturevalue(model)
    rt = Pt2Runtime.open(demo.out)
    assert (demo.out / "model.pt2").stat().st_size < 64 * 1024  # graph only, no weights
    rt.bind(load_ranks(demo))
    x = torch.randn(3, demo.d_model, generator=torch.Generator().manual_seed(9))
    got = rt.infer({"INPUT0": x.numpy()})["OUTPUT0"]
    np.testing.assert_allclose(got, reference_forward(demo, x).numpy(), rtol=1e-5, atol=1e-5)
    probe = json.loads((demo.out / "probe.json").read_text())
    px = np.array(probe["request"]["inputs"][0]["data"], dtype=np.float32).reshape(2, demo.d_model)
    py = rt.infer({"INPUT0": px})["OUTPUT0"]
    np.testing.assert_allclose(py.flatten(), probe["expectedOutputs"][0]["data"], atol=1e-5)


def test_output_depends_on_loaded_weights(demo_tp2: DemoModel, tmp_path: Path) -> None:
    """Perturb one weight in the FILE: the served output changes (weights are not baked in)."""
    x = torch.randn(2, demo_tp2.d_model, generator=torch.Generator().manual_seed(5)).numpy()
    rt = Pt2Runtime.open(demo_tp2.out)
    rt.bind(load_ranks(demo_tp2))
    base = rt.infer({"INPUT0": x})["OUTPUT0"]
    d = copy_model(demo_tp2.out, tmp_path / "m")
    f = rank_files(d, 1, 2)[0]
    t = load_file(str(f))
    t["layers.0.down.weight"] = t["layers.0.down.weight"] * 3.0
    save_file(t, str(f))
    rt2 = Pt2Runtime.open(d)
    rt2.bind(load_ranks(demo_tp2, d))
    changed = rt2.infer({"INPUT0": x})["OUTPUT0"]
    assert np.abs(changed - base).max() > 1e-3
    rt3 = Pt2Runtime.open(d)
    zeroed = {
        r: {k: torch.zeros_like(v) for k, v in ts.items()}
        for r, ts in load_ranks(demo_tp2, d).items()
    }
    rt3.bind(zeroed)
    np.testing.assert_array_equal(rt3.infer({"INPUT0": x})["OUTPUT0"], x)  # residual only


def test_bind_errors_name_tensor_and_file(demo_tp1: DemoModel) -> None:
    rt = Pt2Runtime.open(demo_tp1.out)
    files = {0: {n: "model.safetensors" for n in rt.required()}}
    good = load_ranks(demo_tp1)[0]
    missing = dict(good)
    del missing["layers.2.up.bias"]
    with pytest.raises(
        BindError,
        match=r"'layers\.2\.up\.bias' needed by model\.pt2 is missing from model\.safetensors",
    ):
        rt.bind({0: missing}, files)
    extra = dict(good, **{"lm_head.weight": torch.zeros(2)})
    with pytest.raises(BindError, match=r"tensor 'lm_head\.weight' is not used by model\.pt2"):
        rt.bind({0: extra}, {0: dict(files[0], **{"lm_head.weight": "model.safetensors"})})
    wrong = dict(good, **{"layers.0.up.weight": torch.zeros(3, 3)})
    with pytest.raises(
        BindError, match=r"model\.safetensors: tensor 'layers\.0\.up\.weight' has shape \[3, 3\]"
    ):
        rt.bind({0: wrong}, files)
    half = {k: v.half() for k, v in good.items()}
    with pytest.raises(BindError, match=r"has dtype torch\.float16"):
        rt.bind({0: half}, files)
    with pytest.raises(BindError, match=r"needs ranks \[0\]"):
        rt.bind({1: good})
    assert not rt.bound
    with pytest.raises(InferError, match="not bound"):
        rt.infer({"INPUT0": np.zeros((1, demo_tp1.d_model), np.float32)})


def test_dtype_cast_and_input_checks(demo_tp1: DemoModel) -> None:
    rt = Pt2Runtime.open(demo_tp1.out)
    bound = rt.bind(load_ranks(demo_tp1), dtype="float64" if False else "bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in bound[0].values())
    out = rt.infer({"INPUT0": np.ones((1, demo_tp1.d_model), np.float32)})["OUTPUT0"]
    assert out.dtype == np.float32 and out.shape == (1, demo_tp1.d_model)
    with pytest.raises(InferError, match="has shape"):
        rt.infer({"INPUT0": np.ones((1, 3), np.float32)})
    with pytest.raises(InferError, match="missing input"):
        rt.infer({})
    with pytest.raises(InferError, match="unknown input"):
        rt.infer({"INPUT0": np.ones((1, demo_tp1.d_model), np.float32), "X": np.ones(1)})


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.relu(self.a(x))))


def test_whole_layout_user_program_without_config(tmp_path: Path) -> None:
    """A user's own torch.export program (no model.json): names/shapes come from the program."""
    with torch.device("meta"):
        m = UserModel()
    ep = torch.export.export(
        m,
        (torch.empty(2, 6, device="meta"),),
        dynamic_shapes=({0: torch.export.Dim("b", min=1, max=64)},),
    )
    torch.export.save(ep, str(tmp_path / "model.pt2"))
    real = UserModel()
    save_file(
        {k: v.detach().contiguous() for k, v in real.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    rt = Pt2Runtime.open(tmp_path)
    meta = rt.metadata("user")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 6]}]
    assert meta["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 2]}]
    rt.bind(load_ranks_plain(tmp_path))
    x = torch.randn(5, 6)
    np.testing.assert_allclose(
        rt.infer({"x": x.numpy()})["output0"], real(x).detach().numpy(), atol=1e-6
    )
    assert math.isfinite(float(rt.infer({"x": x.numpy()})["output0"].sum()))


def load_ranks_plain(d: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {0: PreloadLoader().load(make_plan(d), 0, torch.device("cpu"), LoadProgress())}
