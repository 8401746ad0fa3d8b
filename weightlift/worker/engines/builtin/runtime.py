"""Builtin PT2 runtime: a torch.export program (weights stripped) + weights bound at load time.

`model.pt2` is an ExportedProgram saved with its parameters on the meta device, so the file
holds the graph only; the weights come exclusively from the loaded safetensors and are bound by
`torch.func.functional_call` (no copies). `model.json` says how to run it:

* layout "whole": the program is the whole model; its parameter names are the tensor names in
  the files (tp must be 1). This is what a user's own `torch.export` model looks like.
* layout "tp-blocks": the program is one tensor-parallel rank's slice of one residual block;
  tensors are named `layers.{i}.<param>` in each rank's files. For each layer,
  x = x + sum over ranks r of program_r,i(x), which is column-parallel up-projection, GELU,
  row-parallel down-projection, then the all-reduce (a sum here: one process drives all local
  ranks; partial results move to rank 0's device). A pod of a multi-pod replica binds only its
  own ranks and sums their partials; `forward`'s `reduce` then sums that across the group's
  pods (engines/builtin/group.py: torch.distributed, gloo).

AOTInductor packages: `torch._inductor.aoti_compile_and_package` with
`aot_inductor.package_constants_in_so=False` plus `load_constants` can bind external weights,
but compiling even the tiny demo block takes tens of seconds of C++ on CPU and needs a compiler
in the worker image, so ExportedProgram is the default and only format served today.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.progress import LoadError
from weightlift.worker.weights.tensors import (
    DTYPE_NAMES,
    TENSOR_ALIGNMENT,
    canonical_residue,
    place,
)

log = logging.getLogger(__name__)

PROGRAM_FILE = "model.pt2"
CONFIG_FILE = "model.json"

# KServe v2 datatype <-> numpy / torch.
V2_TO_NUMPY: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
TORCH_TO_V2: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.bfloat16: "BF16",
    torch.float32: "FP32",
    torch.float64: "FP64",
}
CAST_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class BindError(LoadError):
    """Loaded tensors do not match what the program needs (permanent: the files are wrong)."""

    permanent = True


class InferError(ValueError):
    """A bad inference request (HTTP 400)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # -1 = any size

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class ModelConfig:
    layout: str = "whole"  # "whole" | "tp-blocks"
    tensor_parallel: int = 1
    num_layers: int = 1
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {
            "format": "weightlift-pt2/v1",
            "layout": self.layout,
            "tensorParallel": self.tensor_parallel,
            "numLayers": self.num_layers,
            "inputs": [s.wire() for s in self.inputs],
            "outputs": [s.wire() for s in self.outputs],
        }

    @classmethod
    def from_wire(cls, doc: dict[str, Any], path: str) -> ModelConfig:
        try:
            cfg = cls(
                layout=str(doc.get("layout", "whole")),
                tensor_parallel=int(doc.get("tensorParallel", 1)),
                num_layers=int(doc.get("numLayers", 1)),
                inputs=[
                    TensorSpec(s["name"], s["datatype"], list(s["shape"]))
                    for s in doc.get("inputs", [])
                ],
                outputs=[
                    TensorSpec(s["name"], s["datatype"], list(s["shape"]))
                    for s in doc.get("outputs", [])
                ],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BindError(f"{path}: invalid model config: {exc!r}") from None
        if cfg.layout not in ("whole", "tp-blocks"):
            raise BindError(f"{path}: unknown layout {cfg.layout!r}")
        if cfg.layout == "whole" and cfg.tensor_parallel != 1:
            raise BindError(f"{path}: layout 'whole' needs tensorParallel 1")
        return cfg


def _signature_specs(ep: torch.export.ExportedProgram) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Input/output metadata from the program itself (when there is no model.json)."""
    nodes = {n.name: n for n in ep.graph.nodes}

    def spec(name: str, node_name: str) -> TensorSpec:
        val = nodes[node_name].meta.get("val") if node_name in nodes else None
        if not isinstance(val, torch.Tensor):
            return TensorSpec(name, "FP32", [-1])
        shape = [int(d) if isinstance(d, int) else -1 for d in val.shape]
        return TensorSpec(name, TORCH_TO_V2.get(val.dtype, "FP32"), shape)

    sig = ep.graph_signature
    ins = [spec(n, n) for n in sig.user_inputs]
    out_nodes = [n for n in ep.graph.nodes if n.op == "output"]
    outs: list[TensorSpec] = []
    if out_nodes:
        args = out_nodes[0].args[0]
        flat = args if isinstance(args, list | tuple) else [args]
        for i, a in enumerate(flat):
            outs.append(spec(f"output{i}", getattr(a, "name", "")))
    return ins, outs


class Pt2Runtime:
    """The served model: program + config + bound weights."""

    def __init__(
        self, model_dir: str | Path, program: torch.export.ExportedProgram, config: ModelConfig
    ) -> None:
        self.model_dir = str(model_dir)
        self.program = program
        self.config = config
        self.module = program.module()
        self._params: dict[str, torch.Tensor] = {k: v for k, v in self.program.state_dict.items()}
        self._bound: list[list[tuple[torch.device, dict[str, torch.Tensor]]]] = []
        self._lock = threading.Lock()
        # The ranks bound here: all of them, or (a pod of a group) this pod's share.
        self.ranks: list[int] = []

    @classmethod
    def open(cls, model_dir: str | Path) -> Pt2Runtime:
        d = Path(model_dir)
        prog = d / PROGRAM_FILE
        if not prog.is_file():
            raise BindError(f"model dir {d}: {PROGRAM_FILE} not found")
        try:
            ep = torch.export.load(str(prog))
        except Exception as exc:
            raise BindError(f"{prog}: cannot load the exported program: {exc}") from exc
        cfg_path = d / CONFIG_FILE
        if cfg_path.is_file():
            try:
                doc = json.loads(cfg_path.read_text())
            except ValueError as exc:
                raise BindError(f"{cfg_path}: not JSON: {exc}") from None
            cfg = ModelConfig.from_wire(doc, str(cfg_path))
        else:
            cfg = ModelConfig()
        if not cfg.inputs or not cfg.outputs:
            ins, outs = _signature_specs(ep)
            cfg.inputs = cfg.inputs or ins
            cfg.outputs = cfg.outputs or outs
        return cls(d, ep, cfg)

    @property
    def bound(self) -> bool:
        return bool(self._bound)

    @property
    def device(self) -> torch.device:
        """Where inputs go and outputs come from: the first bound rank's device."""
        return self._bound[0][0][0] if self._bound else torch.device("cpu")

    def required(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every tensor name one rank must provide, with dtype and shape."""
        params = {k: (v.dtype, tuple(v.shape)) for k, v in self._params.items()}
        if self.config.layout == "whole":
            return params
        return {
            f"layers.{i}.{k}": v for i in range(self.config.num_layers) for k, v in params.items()
        }

    def bind(
        self,
        tensors_by_rank: dict[int, dict[str, torch.Tensor]],
        files_by_rank: dict[int, dict[str, str]] | None = None,
        dtype: str = "auto",
        ranks: list[int] | None = None,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Check every rank's tensors against the program, then bind them. Returns the bound
        tensors (cast when `dtype` is not auto). Raises BindError naming tensor and file.
        `ranks`: the ranks this process holds (a pod of a group: its share; layout tp-blocks);
        by default all of the model's."""
        tp = self.config.tensor_parallel
        want = list(range(tp)) if ranks is None else sorted(ranks)
        if want != list(range(tp)) and (
            self.config.layout != "tp-blocks" or not set(want) <= set(range(tp))
        ):
            raise BindError(
                f"{CONFIG_FILE}: layout {self.config.layout!r} with tensorParallel {tp} cannot "
                f"run ranks {want} alone (a multi-pod replica needs layout 'tp-blocks')"
            )
        if sorted(tensors_by_rank) != want:
            raise BindError(
                f"model needs ranks {want} in this process, got {sorted(tensors_by_rank)}"
            )
        cast = CAST_DTYPES.get(dtype)
        need = self.required()
        out: dict[int, dict[str, torch.Tensor]] = {}
        for r, tensors in tensors_by_rank.items():
            files = (files_by_rank or {}).get(r, {})
            where = sorted(set(files.values())) or [f"rank {r}'s files"]
            for name, (dt, shape) in need.items():
                t = tensors.get(name)
                if t is None:
                    raise BindError(
                        f"rank {r}: tensor {name!r} needed by {PROGRAM_FILE} is missing from "
                        f"{', '.join(where)}"
                    )
                if tuple(t.shape) != shape:
                    raise BindError(
                        f"{files.get(name, f'rank {r}')}: tensor {name!r} has shape "
                        f"{list(t.shape)}, {PROGRAM_FILE} needs {list(shape)}"
                    )
                if t.dtype != dt and cast is None:
                    raise BindError(
                        f"{files.get(name, f'rank {r}')}: tensor {name!r} has dtype {t.dtype}, "
                        f"{PROGRAM_FILE} needs {dt}"
                    )
            extra = sorted(set(tensors) - set(need))
            if extra:
                raise BindError(
                    f"{files.get(extra[0], f'rank {r}')}: tensor {extra[0]!r} is not used by "
                    f"{PROGRAM_FILE} ({len(extra)} extra tensor(s))"
                )
            if cast is not None:
                tensors = {
                    k: (v.to(cast) if v.is_floating_point() else v) for k, v in tensors.items()
                }
            out[r] = self._placed(r, tensors)
        bound: list[list[tuple[torch.device, dict[str, torch.Tensor]]]] = []
        if self.config.layout == "whole":
            t0 = out[0]
            dev = next(iter(t0.values())).device if t0 else torch.device("cpu")
            bound.append([(dev, t0)])
        else:
            names = list(self._params)
            for i in range(self.config.num_layers):
                layer = []
                for r in want:
                    params = {k: out[r][f"layers.{i}.{k}"] for k in names}
                    dev = next(iter(params.values())).device if params else torch.device("cpu")
                    layer.append((dev, params))
                bound.append(layer)
        self._bound = bound
        self.ranks = want
        return out

    def _placed(self, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with each at its canonical residue (weights/tensors.py), so the kernels take
        the same code path whatever loaded the weights (bit-identical outputs). Our loaders
        already place them; anything else is copied here. Without the model's files (a P2P
        target that trusts its source) the source's placement stands."""
        if not any(Path(self.model_dir).glob("*.safetensors")):
            return tensors
        index = shard_index(self.model_dir, rank, self.config.tensor_parallel)
        residues: dict[str, int] = {}
        for name, t in tensors.items():
            _, info = index.tensors.get(name, (None, None))
            if info is not None and info.dtype == DTYPE_NAMES.get(t.dtype):
                residues[name] = canonical_residue(t.device, info.begin, t.element_size())
            else:  # a cast made a fresh tensor: residue 0 on every path (the rule)
                residues[name] = 0
        placed, moved = place(tensors, residues)
        if moved:
            log.warning(
                "rank %d: %d bytes of weights were not at their canonical %d-byte residue; "
                "copied there before binding",
                rank,
                moved,
                TENSOR_ALIGNMENT,
            )
        return placed

    def metadata(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "versions": ["1"],
            "platform": "pytorch_torch_export",
            "inputs": [s.wire() for s in self.config.inputs],
            "outputs": [s.wire() for s in self.config.outputs],
        }

    def _check_input(self, spec: TensorSpec, arr: np.ndarray) -> None:
        # A floating input takes any floating datatype (cast to the weights' dtype below); any
        # other must be the model's own: the program would fail on it (an INT8 into a matmul).
        expected = np.dtype(V2_TO_NUMPY.get(spec.datatype, np.float32))
        if arr.dtype != expected and not (expected.kind == arr.dtype.kind == "f"):
            sent = next((k for k, v in V2_TO_NUMPY.items() if np.dtype(v) == arr.dtype), arr.dtype)
            raise InferError(
                f"input {spec.name!r} has datatype {sent}, model expects {spec.datatype}"
            )
        if len(arr.shape) != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape, arr.shape, strict=True)
        ):
            raise InferError(
                f"input {spec.name!r} has shape {list(arr.shape)}, model expects {spec.shape}"
            )

    def inputs_of(self, inputs: dict[str, np.ndarray]) -> list[torch.Tensor]:
        """The request's inputs, checked against the model, as tensors on the first bound
        device (floating point ones in the weights' dtype)."""
        if not self._bound:
            raise InferError("model weights are not bound yet")
        specs = self.config.inputs
        missing = [s.name for s in specs if s.name not in inputs]
        if missing:
            raise InferError(f"missing input(s) {missing}")
        unknown = sorted(set(inputs) - {s.name for s in specs})
        if unknown:
            raise InferError(f"unknown input(s) {unknown}")
        for s in specs:
            self._check_input(s, inputs[s.name])
        first_dev, first_params = self._bound[0][0]
        pdtype = next(
            (v.dtype for v in first_params.values() if v.is_floating_point()), torch.float32
        )
        args = []
        for s in specs:
            t = torch.from_numpy(np.array(inputs[s.name], copy=True, order="C")).to(first_dev)
            args.append(t.to(pdtype) if t.is_floating_point() else t)
        return args

    def forward(
        self,
        args: list[torch.Tensor],
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Run the bound program. tp-blocks: per layer, the local ranks' partial sums, then
        `reduce` (a pod of a group: the sum over the group's pods) before the residual add."""
        first_dev, first_params = self._bound[0][0]
        with self._lock, torch.inference_mode():
            if self.config.layout == "whole":
                res = functional_call(self.module, first_params, tuple(args))
                return list(res) if isinstance(res, list | tuple) else [res]
            x = args[0]
            for layer in self._bound:
                acc = None
                for dev, params in layer:
                    part = functional_call(self.module, params, (x.to(dev),)).to(first_dev)
                    acc = part if acc is None else acc + part
                assert acc is not None
                if reduce is not None:
                    acc = reduce(acc)
                x = x + acc
            return [x]

    def outputs_of(self, flat: list[torch.Tensor]) -> dict[str, np.ndarray]:
        outs: dict[str, np.ndarray] = {}
        for s, t in zip(self.config.outputs, flat, strict=False):
            np_dtype = V2_TO_NUMPY.get(s.datatype, np.float32)
            if t.dtype == torch.bfloat16:
                t = t.float()
            outs[s.name] = t.detach().cpu().numpy().astype(np_dtype, copy=False)
        return outs

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.outputs_of(self.forward(self.inputs_of(inputs)))
