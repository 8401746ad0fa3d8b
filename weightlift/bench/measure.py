"""What every load bench measures with: the tensors a loader returns, reading them back page by
page, and the machine's memory bandwidth. Below `load`, `remote`, `hfload` and `s3load`, so
those import it and not each other's commands."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

Tensors = dict[str, torch.Tensor]


def touch(tensors: Tensors) -> int:
    """Read one byte of every 4 KiB page: a lazily mmap-backed result (safetensors' load_file,
    safe_open on CPU) pays for its page faults inside the timed region like everyone else."""
    acc = 0
    for t in tensors.values():
        if t.numel():
            b = t.detach().reshape(-1).view(torch.uint8)
            acc += int(b[::4096].sum()) + int(b[-1])
    return acc


def memcpy_gbps(nbytes: int, threads: int, repeat: int = 3) -> float:
    """Multithreaded copy between two pre-faulted buffers (pure memory bandwidth)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # written, so faulted in (np.zeros maps lazily)
    step = -(-nbytes // threads)

    def part(i: int) -> None:
        np.copyto(dst[i * step : (i + 1) * step], src[i * step : (i + 1) * step])

    best = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(part, range(threads)))
            best.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(best)
