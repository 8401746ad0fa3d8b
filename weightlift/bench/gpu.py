"""`weightlift bench gpu --json F`: the weights' whole way onto a GPU, in one run, each figure
beside the limit measured in the same run (issue 44).

Parts, in order: the limits (pinned and pageable H2D, D2D, O_DIRECT read, memcpy;
gpu_limits.py), the loaders into the device warm and cold (ours against the peers that install;
gpu_loaders.py) and first in a fresh process (gpu_first.py), P2P between two processes
(gpu_p2p.py), checksum speed on the device (gpu_checksum.py), and a real worker's lifecycle
(gpu_worker.py); then the issue's goals, pass or fail, on CUDA only (gpu_report.py).

On a host without CUDA it says so, runs the same parts on the CPU with small sizes, and exits 0.
It imports no Kubernetes client and no kopf, and runs without being pip-installed (a bare GPU host
with the tracked files on PYTHONPATH and a few carried wheels: hack/gpu-bench.sh):

    python -m weightlift.bench.gpu --json gpu.json
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

JSON = dict[str, Any]
PARTS = ("limits", "loaders", "first", "p2p", "checksum", "lifecycle")
# Sizes per device kind: the GPU's fit hack/gpu-bench.sh's ~8 minutes; the CPU's a smoke test.
DEFAULTS: dict[str, JSON] = {
    "cuda": {"size_mb": 2048, "repeat": 3, "first_repeat": 3, "pulls": 5, "worker_mb": 256},
    "cpu": {"size_mb": 8, "repeat": 1, "first_repeat": 1, "pulls": 2, "worker_mb": 3},
}
# In a fresh process on CPU (a smoke test): one of ours and one peer; on CUDA every loader.
CPU_FIRST = ("weightlift-preload", "safetensors")


def host_info(device: Any) -> JSON:
    import torch

    info: JSON = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["device_memory_gib"] = round(props.total_memory / (1 << 30), 1)
    else:
        info["device_name"] = "no CUDA (CPU)"
    info["nixl"] = _nixl()
    info["summary"] = (
        f"torch {info['torch']} (CUDA {info['cuda']}), Python {info['python']}, "
        f"{info['cpus']} CPUs, {info.get('nixl') or 'no NIXL'}"
    )
    return info


def _nixl() -> str | None:
    """The NIXL the P2P parts load (nixl_compat's choice) and its wheel's version."""
    from importlib.metadata import PackageNotFoundError, version

    from weightlift.worker.p2p.nixl_compat import NixlUnavailable, nixl

    try:
        name = nixl().__name__.split(".")[0]
    except NixlUnavailable:
        return None
    dist = name.replace("_", "-")
    try:
        return f"{dist} {version(dist)}"
    except PackageNotFoundError:
        return dist


def run(opts: JSON, workdir: Path, save: Any = None) -> JSON:
    """Every part in order; `save(doc)` after each, so a run cut short still leaves its figures."""
    import torch

    from weightlift.bench import gpu_report
    from weightlift.bench.gpu_loaders import write_model

    device = torch.device(opts["device"])
    kind = device.type
    doc: JSON = {"device": str(device), "host": host_info(device), "repeat": opts["repeat"]}
    doc["options"] = {k: v for k, v in opts.items() if k != "json_path"}
    if kind != "cuda":
        doc["note"] = "No CUDA here: the CPU parts ran with small sizes; no goals judged."
    skip = set(opts["skip"])
    model = workdir / "model"
    t0 = time.perf_counter()
    files = write_model(model, opts["size_mb"])
    doc["model"] = {"bytes": sum(f.stat().st_size for f in files), "files": len(files)}
    doc["model"]["write_seconds"] = round(time.perf_counter() - t0, 2)
    steps: JSON = {}

    def step(name: str, fn: Any) -> None:
        if name in skip:
            return
        click.echo(f"bench gpu: {name} ...", err=True)
        t = time.perf_counter()
        try:
            doc[_KEYS[name]] = fn()
        except Exception as exc:  # one part's failure is reported; the others still run
            doc[_KEYS[name]] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        steps[name] = round(time.perf_counter() - t, 1)
        if save is not None:
            save({**doc, "seconds": steps, "partial": True})

    from weightlift.bench.gpu_checksum import run_checksums
    from weightlift.bench.gpu_first import first_in_process
    from weightlift.bench.gpu_limits import measure_limits
    from weightlift.bench.gpu_loaders import LOADERS, run_loaders
    from weightlift.bench.gpu_p2p import run_p2p
    from weightlift.bench.gpu_worker import run_lifecycle

    names = [n for n in LOADERS if not opts["loaders"] or n in opts["loaders"]]
    first = opts["first_loaders"] or (names if kind == "cuda" else list(CPU_FIRST))
    first = [n for n in first if n in names and _runs_first(n, device)]
    step("limits", lambda: measure_limits(files, device, opts["repeat"]))
    step("loaders", lambda: run_loaders(files, device, opts["repeat"], names))
    step("first", lambda: first_in_process(files, str(device), opts["first_repeat"], first))
    step("p2p", lambda: run_p2p(model, workdir, kind, opts["pulls"]))
    step("checksum", lambda: run_checksums(device, doc["model"]["bytes"], opts["repeat"]))
    step("lifecycle", lambda: run_lifecycle(workdir, kind, opts["worker_mb"]))
    doc["seconds"] = steps
    gpu_report.add_ratios(doc)
    if kind == "cuda":
        doc["goals"] = gpu_report.goals(doc)
    return doc


_KEYS = {
    "limits": "limits",
    "loaders": "loaders",
    "first": "first_in_process",
    "p2p": "p2p",
    "checksum": "checksums",
    "lifecycle": "lifecycle",
}


def _runs_first(name: str, device: Any) -> bool:
    from weightlift.bench.gpu_loaders import unavailable

    return unavailable(name, device) is None


@click.command("gpu")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="auto: cuda:0 where CUDA is available, else the CPU parts alone.",
)
@click.option("--size-mb", type=float, default=None, help="Model size (CUDA 2048, CPU 8).")
@click.option("--repeat", type=int, default=None, help="Runs per figure (CUDA 3, CPU 1).")
@click.option("--first-repeat", type=int, default=None, help="Fresh processes per loader.")
@click.option("--pulls", type=int, default=None, help="P2P pulls (median of all but the first).")
@click.option("--worker-mb", type=float, default=None, help="Lifecycle model (CUDA 256, CPU 3).")
@click.option(
    "--first-loader", "first_loaders", multiple=True, help="Loaders run in fresh processes."
)
@click.option("--loader", "loaders", multiple=True, help="Only these loaders (default: all).")
@click.option("--skip", multiple=True, type=click.Choice(PARTS), help="Leave a part out.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
def gpu_command(json_path: Path, device: str, workdir: Path | None, **given: Any) -> None:
    """Limits, loaders, P2P, checksums and a worker's life on the GPU, with issue 44's goals."""
    import torch

    from weightlift.bench.gpu_loaders import LOADERS

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: torch sees no CUDA device here")
    if device == "cpu":
        click.echo("bench gpu: no CUDA here; running the CPU parts with small sizes", err=True)
    kind = device
    opts: JSON = {"device": "cuda:0" if kind == "cuda" else "cpu"}
    for key, value in given.items():
        opts[key] = value if value not in (None, ()) else DEFAULTS[kind].get(key, ())
    opts["skip"] = list(given["skip"])
    opts["first_loaders"] = list(given["first_loaders"])
    opts["loaders"] = list(given["loaders"])
    unknown = sorted((set(opts["loaders"]) | set(opts["first_loaders"])) - set(LOADERS))
    if unknown:
        raise click.BadParameter(f"unknown loader(s) {unknown}; known: {list(LOADERS)}")
    with contextlib.ExitStack() as stack:
        if workdir is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="wl-bench-gpu-"))
            workdir = Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        doc = run(opts, workdir, save=lambda d: _write(json_path, d))
    doc["command"] = " ".join(["weightlift bench gpu", *sys.argv[1:]])
    _write(json_path, doc)
    from weightlift.bench.gpu_report import print_report

    print_report(doc)
    click.echo(f"wrote {json_path}")


def _write(path: Path, doc: JSON) -> None:
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def main() -> None:
    """Entry point without pip install (no entry points there)."""
    gpu_command(prog_name="python -m weightlift.bench.gpu")


if __name__ == "__main__":
    main()
