"""First load in a fresh process: what a worker pays once, CUDA context and first allocations
included (a median of N warm runs in one process hides them). One subprocess per load:

    python -m weightlift.bench.gpu_first --loader NAME --device cuda FILE...

prints one JSON line: seconds from the first device call to the loaded, synchronised tensors
(imports measured apart), and an xxh3 of every tensor's bytes for the parent to check."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Only the standard library up here: the child times its own imports.
JSON = dict[str, Any]


def _digest(tensors: dict[str, object]) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        t = tensors[name]
        assert isinstance(t, torch.Tensor)
        h.update(name.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def reference_digest(files: list[Path]) -> str:
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return _digest(tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightlift.bench.gpu_first")
    parser.add_argument("--loader", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from weightlift.bench.gpu_loaders import LOADERS, finish

    fn = LOADERS[args.loader]
    imports = time.perf_counter() - t0
    device = torch.device(args.device)
    t1 = time.perf_counter()
    tensors, close = fn(args.files, device)
    finish(tensors, device)
    seconds = time.perf_counter() - t1
    digest = _digest(dict(tensors))
    close()
    print(json.dumps({"seconds": seconds, "imports": imports, "digest": digest}), flush=True)
    return 0


def first_in_process(
    files: list[Path], device: str, repeat: int, names: list[str], timeout: float = 300
) -> JSON:
    """Each loader `repeat` times, each time in a fresh process (page cache warm)."""
    from weightlift.bench.gpu_limits import spread
    from weightlift.worker.weights.files import index_files

    nbytes = index_files(files).data_bytes
    want = reference_digest(files)
    out: JSON = {}
    for name in names:
        runs, errors = [], []
        for _ in range(repeat):
            p = subprocess.run(
                [
                    *(sys.executable, "-m", "weightlift.bench.gpu_first"),
                    *("--loader", name, "--device", device, *map(str, files)),
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                errors.append(f"exit {p.returncode}: {p.stderr.strip()[-400:]}")
                continue
            runs.append(json.loads(lines[-1]))
        if not runs:
            out[name] = {"error": errors[0] if errors else "no run"}
            continue
        out[name] = {
            **spread([r["seconds"] for r in runs], nbytes),
            "imports_seconds": round(statistics.median(r["imports"] for r in runs), 3),
            "verified": all(r["digest"] == want for r in runs) and not errors,
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
