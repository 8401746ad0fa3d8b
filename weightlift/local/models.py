"""`weightlift model make-demo`: a real PT2 model with sidecar safetensors and an init hook.

The model is a stack of residual MLP blocks; each block is tensor-parallel (column-parallel
up-projection with bias, GELU, row-parallel down-projection, sum over ranks). `model.pt2` holds
one rank's block program with meta (empty) weights; rank r's weights go to
`rank-{r}-of-{tp}.safetensors` (tp > 1) or `model.safetensors` (tp == 1), split into parts when
`parts > 1`. Also written: `model.json` (runtime config), `hooks/libinit.c` + `hooks/libinit.so`
(gcc) and `probe.json`, a KServe v2 request with the expected output.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from safetensors.torch import save_file
from torch import nn

from weightlift.worker.engines.builtin.runtime import (
    CONFIG_FILE,
    PROGRAM_FILE,
    ModelConfig,
    TensorSpec,
)

HOOK_C_SOURCE = r"""
/* weightlift demo init hook: records init/release to $WEIGHTLIFT_HOOK_LOG when set. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int device; char dir[4096]; } wl_state;

static void wl_log(const char *what, const char *dir, int dev, void *h) {
    const char *p = getenv("WEIGHTLIFT_HOOK_LOG");
    if (!p || !*p) return;
    FILE *f = fopen(p, "a");
    if (!f) return;
    fprintf(f, "%s %s %d %llu\n", what, dir, dev, (unsigned long long)(uintptr_t)h);
    fclose(f);
}

void *triton_pytorch_model_init(const char *model_dir, int device_index) {
    wl_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->device = device_index;
    strncpy(s->dir, model_dir, sizeof s->dir - 1);
    wl_log("init", model_dir, device_index, s);
    return s;
}

void triton_pytorch_model_release(void *h) {
    wl_state *s = h;
    if (!s) return;
    wl_log("release", s->dir, s->device, h);
    free(s);
}
"""


class ShardBlock(nn.Module):
    """One rank's slice of a residual MLP block (the residual and the sum live in the runtime)."""

    def __init__(self, d_model: int, d_ff_local: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff_local, bias=True)
        self.down = nn.Linear(d_ff_local, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def build_hook_library(out_so: Path, source: str = HOOK_C_SOURCE) -> Path:
    """Write `source` next to `out_so` and compile it with gcc into a shared library."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise click.ClickException("gcc is needed to build the init hook library")
    out_so.parent.mkdir(parents=True, exist_ok=True)
    src = out_so.with_suffix(".c")
    src.write_text(source)
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-o", str(out_so), str(src)],
        check=True,
        capture_output=True,
    )
    return out_so


def export_block(d_model: int, d_ff_local: int) -> torch.export.ExportedProgram:
    """Export the block on the meta device: the program carries no weight bytes."""
    with torch.device("meta"):
        block = ShardBlock(d_model, d_ff_local)
        example = torch.empty(2, d_model)
    batch = torch.export.Dim("batch", min=1, max=4096)
    return torch.export.export(block, (example,), dynamic_shapes=({0: batch},))


@dataclass(frozen=True)
class DemoModel:
    out: Path
    d_model: int
    d_ff: int
    num_layers: int
    tp: int
    bytes_total: int
    files: list[Path]


def dims_for(size_mb: float) -> tuple[int, int]:
    return (512, 2048) if size_mb >= 64 else (128, 512)


def make_demo(
    out: Path,
    size_mb: float,
    tp: int = 1,
    hook: bool = True,
    parts: int = 1,
    seed: int = 0,
) -> DemoModel:
    d, f = dims_for(size_mb)
    if f % tp:
        raise click.ClickException(f"tensor-parallel size {tp} must divide d_ff={f}")
    per_layer = 4 * (2 * d * f + f)
    layers = max(1, math.ceil(size_mb * 1e6 / per_layer))
    parts = max(1, min(parts, layers))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    gen = torch.Generator().manual_seed(seed)
    fl = f // tp
    files: list[Path] = []
    total = 0
    for r in range(tp):
        per_part = math.ceil(layers / parts)
        for p in range(parts):
            tensors: dict[str, torch.Tensor] = {}
            for i in range(p * per_part, min(layers, (p + 1) * per_part)):
                # Each rank draws its own slice; std keeps activations O(1) over many layers.
                up_w = torch.randn(fl, d, generator=gen) / math.sqrt(d)
                up_b = torch.randn(fl, generator=gen) * 0.1
                down_w = torch.randn(d, fl, generator=gen) / math.sqrt(f * layers)
                tensors[f"layers.{i}.up.weight"] = up_w
                tensors[f"layers.{i}.up.bias"] = up_b
                tensors[f"layers.{i}.down.weight"] = down_w
            if tp == 1:
                name = (
                    "model.safetensors"
                    if parts == 1
                    else (f"model-{p + 1:05d}-of-{parts:05d}.safetensors")
                )
            else:
                name = (
                    f"rank-{r}-of-{tp}.safetensors"
                    if parts == 1
                    else (f"rank-{r}-of-{tp}-{p + 1:05d}.safetensors")
                )
            path = out / name
            save_file(tensors, str(path), metadata={"weightlift": "demo", "rank": str(r)})
            # safetensors writes 0600 (a temp file renamed); a real node's worker runs as uid
            # 1000 and reads the hostPath model as it is: make it world-readable like the rest.
            path.chmod(0o644)
            files.append(path)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    torch.export.save(export_block(d, fl), str(out / PROGRAM_FILE))
    cfg = ModelConfig(
        layout="tp-blocks",
        tensor_parallel=tp,
        num_layers=layers,
        inputs=[TensorSpec("INPUT0", "FP32", [-1, d])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [-1, d])],
    )
    (out / CONFIG_FILE).write_text(json.dumps(cfg.wire(), indent=2) + "\n")
    if hook:
        build_hook_library(out / "hooks" / "libinit.so")
    _write_probe(out, d, tp, layers, seed)
    return DemoModel(out, d, f, layers, tp, total, files)


def reference_output(out: Path, tp: int, num_layers: int, x: torch.Tensor) -> torch.Tensor:
    """The demo model's output for `x`, written out with plain torch ops on the weights read
    back from its safetensors files (safetensors' own load_file): for each layer,
    x = x + sum over ranks r of gelu(x @ up_r.T + b_r) @ down_r.T. Nothing of the runtime the
    worker serves with (Pt2Runtime: the exported program, binding, the rank sum), so a probe
    built on it checks that runtime instead of repeating it."""
    from safetensors.torch import load_file

    from weightlift.worker.weights.files import rank_files

    ranks: list[dict[str, torch.Tensor]] = []
    for r in range(tp):
        t: dict[str, torch.Tensor] = {}
        for p in rank_files(out, r, tp):
            t.update(load_file(str(p)))
        ranks.append(t)
    with torch.no_grad():
        for i in range(num_layers):
            acc = torch.zeros_like(x)
            for w in ranks:
                up = x @ w[f"layers.{i}.up.weight"].T + w[f"layers.{i}.up.bias"]
                acc = acc + torch.nn.functional.gelu(up) @ w[f"layers.{i}.down.weight"].T
            x = x + acc
    return x


def _write_probe(out: Path, d: int, tp: int, num_layers: int, seed: int) -> None:
    """probe.json: a sample request and the output this model must give, computed by
    `reference_output` (not by the runtime under test) on exactly the request's inputs."""
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(seed + 1))
    # The request carries rounded inputs: the expectation is computed on exactly those.
    data = [round(float(v), 6) for v in x.flatten()]
    y = reference_output(out, tp, num_layers, torch.tensor(data, dtype=torch.float32).view(2, d))
    probe = {
        "request": {
            "inputs": [{"name": "INPUT0", "shape": [2, d], "datatype": "FP32", "data": data}],
            "outputs": [{"name": "OUTPUT0"}],
        },
        "expectedOutputs": [
            {"name": "OUTPUT0", "shape": list(y.shape), "data": [float(v) for v in y.flatten()]}
        ],
        "tolerance": 1e-3,
    }
    (out / "probe.json").write_text(json.dumps(probe) + "\n")


@click.group("model")
def model_group() -> None:
    """Make demo models."""


@model_group.command("make-demo")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--size-mb",
    type=float,
    default=16.0,
    show_default=True,
    help="Approximate size of the safetensors weights (all ranks).",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks.")
@click.option("--parts", type=int, default=1, show_default=True, help="Files per rank.")
@click.option(
    "--hook/--no-hook", default=True, show_default=True, help="Build hooks/libinit.so with gcc."
)
@click.option("--seed", type=int, default=0, show_default=True)
def make_demo_command(
    out: Path, size_mb: float, tp: int, parts: int, hook: bool, seed: int
) -> None:
    """Write model.pt2, model.json, safetensors, hooks/libinit.so and probe.json to OUT."""
    if tp < 1 or size_mb <= 0:
        raise click.BadParameter("--tp must be >= 1 and --size-mb > 0")
    m = make_demo(out, size_mb, tp=tp, hook=hook, parts=parts, seed=seed)
    click.echo(
        f"wrote {m.out}: {m.num_layers} layers d_model={m.d_model} d_ff={m.d_ff} tp={m.tp}, "
        f"{m.bytes_total / 1e6:.1f} MB in {len(m.files)} file(s)"
    )
