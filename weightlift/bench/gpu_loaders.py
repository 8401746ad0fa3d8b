"""The loaders `bench gpu` races onto one device: ours (Preload, Direct) and the peers that
install (safetensors, runai-model-streamer, fastsafetensors), warm and cold page cache, each a
median of N checked bit for bit against `safetensors.load_file`. A peer that is not importable is
listed as "not installed"; one that fails is listed with its error, and the run goes on."""

from __future__ import annotations

import gc
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch

from weightlift.bench.gpu_limits import JSON, drop_and_check, spread
from weightlift.bench.measure import Tensors, touch
from weightlift.worker.loaders.direct import DirectLoader
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.weights.files import index_files
from weightlift.worker.weights.progress import LoadProgress

Closer = Callable[[], None]
GpuLoader = Callable[[list[Path], torch.device], tuple[Tensors, Closer]]


def write_model(out: Path, size_mb: float, parts: int = 4, seed: int = 0) -> list[Path]:
    """`parts` safetensors files of random bf16 tensors (64 MiB at most each), about `size_mb`
    MB in all, named as a sharded checkpoint (model-0000k-of-0000n). No program: the loaders
    and P2P need only the weights."""
    import numpy as np
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_part = int(size_mb * 1e6) // parts
    tensor = min(64 << 20, max(4096, per_part // 4)) // 1024 * 1024
    files = []
    for p in range(parts):
        tensors: Tensors = {}
        sizes = [tensor] * (per_part // tensor)
        if per_part % tensor >= 1024 or not sizes:
            sizes.append(max(1024, per_part % tensor // 1024 * 1024))
        for i, n in enumerate(sizes):
            raw = torch.frombuffer(bytearray(rng.bytes(n)), dtype=torch.uint8)
            tensors[f"part{p}.w{i}"] = raw.view(torch.bfloat16).reshape(-1, 512)
        path = out / f"model-{p + 1:05d}-of-{parts:05d}.safetensors"
        save_file(tensors, str(path))
        files.append(path)
    return files


def _noop() -> None:
    return None


def wl_preload(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    return PreloadLoader().load_index(index_files(files), device, LoadProgress()), _noop


def wl_direct(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    return DirectLoader().load_index(index_files(files), device, LoadProgress()), _noop


def st_load_file(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    from safetensors.torch import load_file

    out: Tensors = {}
    for f in files:
        out.update(load_file(str(f), device=str(device)))
    return out, _noop


def st_pinned(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    """The naive fast path: load to CPU, pin, copy without blocking."""
    from safetensors.torch import load_file

    out: Tensors = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            out[k] = v.pin_memory().to(device, non_blocking=True)
    return out, _noop


def runai(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    from runai_model_streamer import SafetensorsStreamer

    out: Tensors = {}
    streamer = SafetensorsStreamer()
    streamer.__enter__()
    for f in files:
        streamer.stream_file(str(f), device=str(device))
        for name, t in streamer.get_tensors():
            out[name] = t.to(device)
    return out, lambda: streamer.__exit__(None, None, None)


def fastsafetensors(files: list[Path], device: torch.device) -> tuple[Tensors, Closer]:
    from fastsafetensors import fastsafe_open

    ctx = fastsafe_open(filenames=[str(f) for f in files], nogds=True, device=str(device))
    f = ctx.__enter__()
    out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out, lambda: ctx.__exit__(None, None, None)


LOADERS: dict[str, GpuLoader] = {
    "weightlift-preload": wl_preload,
    "weightlift-direct": wl_direct,
    "safetensors": st_load_file,
    "safetensors+pin": st_pinned,
    "runai-model-streamer": runai,
    "fastsafetensors": fastsafetensors,
}
# The module each peer needs; ours and safetensors are always there.
NEEDS = {"runai-model-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}
OURS = ("weightlift-preload", "weightlift-direct")


def unavailable(name: str, device: torch.device) -> str | None:
    """Why loader `name` cannot run here, or None."""
    module = NEEDS.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        return "not installed"
    if name == "safetensors+pin" and device.type != "cuda":
        return "needs CUDA (pinned memory)"
    return None


def finish(tensors: Tensors, device: torch.device) -> None:
    """What every timed load ends with: its copies done (CUDA) or its pages faulted in (CPU:
    lazily mapped results pay their faults too)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        touch(tensors)


def bit_equal(tensors: Tensors, reference: Tensors) -> bool:
    if tensors.keys() != reference.keys():
        return False
    for k, ref in reference.items():
        t = tensors[k]
        if t.dtype != ref.dtype or t.shape != ref.shape:
            return False
        a = t.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a.to(ref.device), ref.contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True


def reference_tensors(files: list[Path], device: torch.device) -> Tensors:
    """safetensors' own result, copied out of its mapping (a file that stays mapped would keep
    its pages cached and every cold run warm), on the device the loaders load to."""
    from safetensors.torch import load_file

    out: Tensors = {}
    for f in files:
        out.update({k: v.to(device, copy=True) for k, v in load_file(str(f)).items()})
    return out


def _one(fn: GpuLoader, files: list[Path], device: torch.device, reference: Tensors) -> JSON:
    gc.collect()
    t0 = time.perf_counter()
    tensors, close = fn(files, device)
    finish(tensors, device)
    secs = time.perf_counter() - t0
    ok = bit_equal(tensors, reference)
    del tensors
    close()
    return {"seconds": secs, "verified": ok}


def run_loaders(files: list[Path], device: torch.device, repeat: int, names: list[str]) -> JSON:
    """Per loader: an untimed warm-up, then `repeat` rounds of a cold and a warm load."""
    nbytes = index_files(files).data_bytes
    reference = reference_tensors(files, device)
    results: JSON = {}
    drops: list[JSON] = []
    for name in names:
        why = unavailable(name, device)
        if why is not None:
            results[name] = {"skipped": why}
            continue
        fn = LOADERS[name]
        try:
            _one(fn, files, device, reference)  # imports, thread pools, CUDA context, allocator
            runs: dict[str, list[JSON]] = {"cold": [], "warm": []}
            for _ in range(repeat):
                drops.append(drop_and_check(files))
                runs["cold"].append(_one(fn, files, device, reference))
                runs["warm"].append(_one(fn, files, device, reference))
        except Exception as exc:  # a peer's own failure is a result, not the end of the run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        results[name] = {
            cache: {
                **spread([r["seconds"] for r in rs], nbytes),
                "verified": all(r["verified"] for r in rs),
            }
            for cache, rs in runs.items()
        }
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "results": results, "cold_drop": summarize_drops(drops)}


def summarize_drops(drops: list[JSON]) -> JSON:
    """Whether every cold run started from a dropped cache; the worst residue seen."""
    left = [d["cached_after"] for d in drops if d["cached_after"] is not None]
    verdicts = [d["dropped"] for d in drops]
    if not drops:
        return {"dropped": None, "note": "no cold runs"}
    if any(v is None for v in verdicts):
        note = "could not check the drop (no mincore): cold runs may be warm"
        dropped: bool | None = None
    elif all(verdicts):
        note = "page cache dropped before every cold run (posix_fadvise DONTNEED, mincore)"
        dropped = True
    else:
        note = "could not drop the page cache: the cold runs read (partly) cached files"
        dropped = False
    return {"dropped": dropped, "max_cached_after": max(left) if left else None, "note": note}


def best_peer(results: JSON, cache: str) -> tuple[str, float] | None:
    """The fastest loader that is not ours, in `cache`."""
    peers = [
        (name, r[cache]["gbps"])
        for name, r in results.items()
        if name not in OURS and cache in r and r[cache]["verified"]
    ]
    return max(peers, key=lambda p: p[1]) if peers else None
