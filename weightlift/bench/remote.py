"""What `bench load --uri s3://` and `--uri hf://` share: timing contenders that fetch the same
remote files into a fresh directory, the store's raw ranged-GET ceiling, and the table."""

from __future__ import annotations

import gc
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from weightlift.bench.measure import Tensors, memcpy_gbps, touch
from weightlift.worker.storage.ranged import F, ReadRange, ranges
from weightlift.worker.weights.tensors import all_bit_equal

# Tensors and a closer (runai owns its buffers until its streamer closes), from a scratch dir.
RemoteLoader = Callable[[Path], tuple[Tensors, Callable[[], None]]]


def noop() -> None:
    return None


def ignore(_nbytes: int) -> None:
    return None


def time_loaders(
    available: dict[str, RemoteLoader],
    loaders: list[str],
    reference: Tensors,
    repeat: int,
    scratch: Path,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(medians per loader, every run): each run into a fresh scratch dir, touched, verified."""
    nbytes = sum(t.numel() * t.element_size() for t in reference.values())
    for name in loaders:  # untimed warm-up: imports, clients, thread pools, native library init
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            tensors, close = available[name](Path(tmp))
            del tensors
            close()
    runs: list[dict[str, Any]] = []
    for _ in range(repeat):
        for name in loaders:
            with tempfile.TemporaryDirectory(dir=scratch) as tmp:
                gc.collect()
                t0, c0 = time.perf_counter(), time.process_time()
                tensors, close = available[name](Path(tmp))
                touch(tensors)
                secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                ok = all_bit_equal(tensors, reference)
                del tensors
                close()
            runs.append(
                {
                    "loader": name,
                    "seconds": secs,
                    "cpu_seconds": cpu,
                    "gbps": nbytes / secs / 1e9,
                    "verified": ok,
                }
            )
    results = []
    for name in loaders:
        rs = [r for r in runs if r["loader"] == name]
        secs = statistics.median(r["seconds"] for r in rs)
        results.append(
            {
                "loader": name,
                "gbps": round(nbytes / secs / 1e9, 3),
                "seconds": round(secs, 4),
                # this process's CPU (every thread; an in-process server's too): steadier than
                # wall time on a busy machine
                "cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in rs), 4),
                "verified": all(r["verified"] for r in rs),
                "runs": len(rs),
            }
        )
    return results, runs


def ranged_get_gbps(files: list[F], read_range: ReadRange[F], threads: int, chunk: int) -> float:
    """The same ranged GETs as the loader's, each piece copied into one anonymous region (no
    files, no tensors): what the store and the HTTP stack deliver here."""
    bases, total = {}, 0
    for f in files:
        bases[f.name] = total
        total += f.size
    buf = mmap.mmap(-1, total)
    view = memoryview(buf)

    def get(job: tuple[F, int, int]) -> None:
        f, start, n = job
        base = bases[f.name]

        def sink(piece: memoryview, offset: int) -> None:
            view[base + offset : base + offset + len(piece)] = piece

        read_range(f, start, n, sink)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, ranges(files, chunk)))
    secs = time.perf_counter() - t0
    view.release()
    buf.close()
    return total / secs / 1e9


def bench_remote(
    available: dict[str, RemoteLoader],
    loaders: list[str],
    reference: Tensors,
    *,
    scratch: Path,
    repeat: int,
    threads: int,
    chunk_mib: int,
    cache: str,
    ceiling: tuple[str, Callable[[], float]],
    doc: dict[str, Any],
    notes: list[str],
) -> dict[str, Any]:
    """The contenders timed against `reference` and the store's raw ceiling (`ceiling`: its key
    in `limits` and one measurement), as one result document that starts with `doc`."""
    nbytes = sum(t.numel() * t.element_size() for t in reference.values())
    results, runs = time_loaders(available, loaders, reference, repeat, scratch)
    for r in results:
        r["cache"] = cache
    ceiling_key, measure_ceiling = ceiling
    ceiling_runs = [measure_ceiling() for _ in range(repeat)]
    return {
        **doc,
        "bytes": nbytes,
        "repeat": repeat,
        "threads": threads,
        "chunk_mib": chunk_mib,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "limits": {
            "memcpy_gbps": round(memcpy_gbps(min(nbytes, 1 << 30), max(2, os.cpu_count() or 1)), 3),
            ceiling_key: round(statistics.median(ceiling_runs), 3),
        },
        "results": results,
        "runs": runs,
        "notes": notes,
    }


def write_doc(
    doc: dict[str, Any],
    *,
    json_path: Path,
    uri: str,
    endpoint: str | None,
    local_server: str,
    args: str,
    loaders: list[str],
    known: list[str],
) -> dict[str, Any]:
    """Where the store was (`endpoint`; None: `local_server`, started by the bench) and the
    command that measures the same again, added to `doc`, written to `json_path`."""
    doc["endpoint"] = f"{local_server} (started by the bench)" if endpoint is None else endpoint
    doc["command"] = (
        f"weightlift bench load --uri {uri}"
        + ("" if endpoint is None else f" --endpoint {endpoint}")
        + f" {args} --json {json_path}"
        + "".join(f" --loader {n}" for n in loaders if len(loaders) < len(known))
    )
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def print_remote_table(doc: dict[str, Any], ceiling_key: str, ceiling_label: str) -> None:
    from rich.console import Console
    from rich.table import Table

    lim = doc["limits"]
    ceiling = lim[ceiling_key]
    others = [r["gbps"] for r in doc["results"] if not r["loader"].startswith("weightlift")]
    best_peer = max(others, default=0.0)
    t = Table(
        title=f"weightlift bench load {doc['uri']}: {doc['bytes'] / 1e6:.0f} MB, median of "
        f"{doc['repeat']}, {ceiling_label} {ceiling} GB/s, memcpy {lim['memcpy_gbps']} GB/s"
    )
    cols = ("loader", "GB/s", "seconds", "CPU s", f"x {ceiling_label}", "x best peer", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col == "loader" else "right", no_wrap=True)
    for r in doc["results"]:
        t.add_row(
            r["loader"],
            f"{r['gbps']:.2f}",
            f"{r['seconds']:.3f}",
            f"{r['cpu_seconds']:.2f}",
            f"{r['gbps'] / ceiling:.2f}" if ceiling else "-",
            f"{r['gbps'] / best_peer:.2f}" if best_peer else "-",
            "yes" if r["verified"] else "NO",
        )
    console = Console()
    console.width = max(console.width, 110)
    console.print(t)
    for note in doc.get("notes", []):
        console.print(f"- {note}", highlight=False)
