"""`weightlift bench load`: load GB/s of our loaders vs safetensors, fastsafetensors and runai-
model-streamer on the same files, warm and cold page cache, with the machine's own limits
(multithreaded memcpy, O_DIRECT read) measured in the same run. Every result is checked bit for
bit against safetensors' `load_file`; medians of `--repeat` runs go to the table, JSON and PNG.

Timed: the loader call plus reading one byte per page of the result (so loaders that return
lazily mmap-backed tensors pay their page faults too). Cold runs call
`posix_fadvise(POSIX_FADV_DONTNEED)` on every file first (no root needed; it drops the clean
cached pages of those files). Warm runs follow a cold run of the same loader.

Not run by default (`--loader weightlift-preload-staged`): Preload's staged path on CPU, i.e.
read into staging buffers and copy into one result buffer (what the CUDA path does before its
H2D copies), to see what the copy costs next to the zero-copy CPU path.
"""

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import torch

from weightlift.bench.measure import Tensors, memcpy_gbps, touch
from weightlift.worker.loaders.direct import DirectLoader
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.weights.files import index_files, rank_files
from weightlift.worker.weights.progress import LoadProgress
from weightlift.worker.weights.tensors import all_bit_equal

# A loader returns its tensors and a closer (some libraries own the memory until closed).
BenchLoader = Callable[[list[Path]], tuple[Tensors, Callable[[], None]]]


def _noop() -> None:
    return None


def copied_bytes(tensors: Tensors, files: list[Path]) -> int | None:
    """Bytes of `tensors` that are not views of a mapping of `files` (read or copied into other
    memory); None where /proc/self/maps is missing (not Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    names = {str(f.resolve()) for f in files}
    spans = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in names:
            lo, hi = fields[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    copied = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        start = t.data_ptr()
        if n and not any(lo <= start and start + n <= hi for lo, hi in spans):
            copied += n
    return copied


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages: a just-written model would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_loaders(threads: int, chunk_mib: int) -> dict[str, BenchLoader]:
    cpu = torch.device("cpu")

    def wl_preload(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        idx = index_files(files)
        t = PreloadLoader().load_index(
            idx, cpu, LoadProgress(), threads=threads, chunk_bytes=chunk_mib << 20
        )
        return t, _noop

    def wl_preload_staged(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        idx = index_files(files)
        t = PreloadLoader(staged=True).load_index(
            idx, cpu, LoadProgress(), threads=threads, chunk_bytes=chunk_mib << 20
        )
        return t, _noop

    def wl_direct(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        return DirectLoader().load_index(index_files(files), cpu, LoadProgress()), _noop

    def st_load_file(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        from safetensors.torch import load_file

        out: Tensors = {}
        for f in files:
            out.update(load_file(str(f)))
        return out, _noop

    def fastsafetensors(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        from fastsafetensors import fastsafe_open

        ctx = fastsafe_open(filenames=[str(f) for f in files], nogds=True, device="cpu")
        f = ctx.__enter__()
        out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        return out, lambda: ctx.__exit__(None, None, None)

    def runai(files: list[Path]) -> tuple[Tensors, Callable[[], None]]:
        from runai_model_streamer import SafetensorsStreamer

        out: Tensors = {}
        streamer = SafetensorsStreamer()
        streamer.__enter__()
        for f in files:
            streamer.stream_file(str(f))
            for name, t in streamer.get_tensors():
                out[name] = t
        return out, lambda: streamer.__exit__(None, None, None)

    return {
        "weightlift-preload": wl_preload,
        "weightlift-direct": wl_direct,
        "safetensors": st_load_file,
        "fastsafetensors": fastsafetensors,
        "runai-model-streamer": runai,
        "weightlift-preload-staged": wl_preload_staged,
    }


# Loaders `make_loaders` knows that run only when asked for with --loader.
OPT_IN = {"weightlift-preload-staged"}

# Where the time goes, printed under the table and stored in the JSON; "copied MB" in the table
# is measured per run (bytes of the result that are not views of the files' mappings).
NOTES = [
    "weightlift-preload (CPU): files mapped MAP_PRIVATE into one region, then "
    "madvise(MADV_POPULATE_READ) in parallel ranges; every tensor stays a view of its file's "
    "mapping (each sits at its file offset mod 64, the placement every load path and P2P "
    "target uses, so outputs are bit-identical without realigning): warm = page-table setup "
    "only; cold = kernel readahead into the page cache, one sequential stream per file "
    "(compare odirect_read_gbps). Every page is mapped on return. Only a tensor whose offset "
    "is not a multiple of its element size is copied (torch cannot view it).",
    "safetensors / weightlift-direct (CPU): mmap, lazily faulted page by page inside the timed "
    "touch (weightlift-direct places tensors like preload: no copy either); fastsafetensors / "
    "runai-model-streamer: read (copy) into their own host buffers.",
    "weightlift-preload-staged (opt-in): the CUDA path on CPU: read into staging buffers, copy "
    "into one result buffer (fresh anonymous pages: zeroing + copy).",
]


def odirect_read_gbps(files: list[Path], threads: int, chunk: int = 16 << 20) -> float | None:
    """O_DIRECT reads of the files (parallel, aligned buffers): the storage's own speed."""
    if not hasattr(os, "O_DIRECT"):
        return None
    jobs = []
    total = 0
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, chunk):
            jobs.append((f, off))
        total += size

    def read(job: tuple[Path, int], buf: mmap.mmap) -> int:
        f, off = job
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf], off)
        finally:
            os.close(fd)

    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            got = sum(pool.map(lambda ij: read(ij[1], bufs[ij[0] % threads]), enumerate(jobs)))
            secs = time.perf_counter() - t0
    except OSError:
        return None  # filesystem without O_DIRECT (tmpfs)
    finally:
        for b in bufs:
            b.close()
    return got / secs / 1e9 if got >= total else None


@dataclass
class Run:
    loader: str
    cache: str
    seconds: float
    gbps: float
    verified: bool
    copied_bytes: int | None  # of the result, not a view of the files' mappings


def bench(
    files: list[Path], repeat: int, threads: int, chunk_mib: int, loaders: list[str]
) -> dict[str, Any]:
    from safetensors.torch import load_file

    nbytes = index_files(files).data_bytes
    # The reference is copied out of safetensors' mmap: a file that stays mapped keeps its pages
    # in the page cache, and every later "cold" run would silently be warm.
    reference: Tensors = {}
    for f in files:
        reference.update({k: v.clone() for k, v in load_file(str(f)).items()})
    gc.collect()
    available = make_loaders(threads, chunk_mib)
    runs: list[Run] = []
    for name in loaders:  # untimed warm-up: imports, thread pools, native library init
        tensors, close = available[name](files)
        del tensors
        close()
    for _ in range(repeat):
        for name in loaders:
            fn = available[name]
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop_cache(files)
                gc.collect()
                t0 = time.perf_counter()
                tensors, close = fn(files)
                touch(tensors)
                secs = time.perf_counter() - t0
                ok = all_bit_equal(tensors, reference)
                copied = copied_bytes(tensors, files)
                del tensors
                close()
                runs.append(Run(name, cache, secs, nbytes / secs / 1e9, ok, copied))
    ncpu = os.cpu_count() or 1
    mem, odr = [], []
    for _ in range(repeat):  # limits measured as often as the loaders, medians reported
        mem.append(memcpy_gbps(min(nbytes, 1 << 30), max(2, ncpu)))
        drop_cache(files)
        od = odirect_read_gbps(files, max(2, ncpu))
        if od is not None:
            odr.append(od)
    limits = {
        "memcpy_gbps": round(statistics.median(mem), 3),
        "odirect_read_gbps": round(statistics.median(odr), 3) if odr else None,
    }
    results = []
    for name in loaders:
        for cache in ("warm", "cold"):
            rs = [r for r in runs if r.loader == name and r.cache == cache]
            secs = statistics.median(r.seconds for r in rs)
            results.append(
                {
                    "loader": name,
                    "cache": cache,
                    "gbps": round(nbytes / secs / 1e9, 3),
                    "seconds": round(secs, 4),
                    "verified": all(r.verified for r in rs),
                    "copied_bytes": max(
                        (r.copied_bytes for r in rs if r.copied_bytes is not None), default=None
                    ),
                    "runs": len(rs),
                }
            )
    return {
        "bytes": nbytes,
        "files": [str(f) for f in files],
        "repeat": repeat,
        "threads": threads,
        "chunk_mib": chunk_mib,
        "cpus": ncpu,
        "torch": torch.__version__,
        "limits": limits,
        "results": results,
        "runs": [asdict(r) for r in runs],
        "notes": NOTES,
    }


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    lim = doc["limits"]
    memcpy = lim["memcpy_gbps"]
    best_peer = {
        c: max(
            (
                r["gbps"]
                for r in doc["results"]
                if r["cache"] == c and not r["loader"].startswith("weightlift")
            ),
            default=0.0,
        )
        for c in ("warm", "cold")
    }
    t = Table(
        title=f"weightlift bench load: {doc['bytes'] / 1e6:.0f} MB, median of {doc['repeat']}, "
        f"memcpy {memcpy} GB/s, O_DIRECT read {lim['odirect_read_gbps']} GB/s"
    )
    for col in (
        "loader",
        "cache",
        "GB/s",
        "seconds",
        "x memcpy",
        "x best peer",
        "copied MB",
        "verified",
    ):
        t.add_column(col, justify="left" if col in ("loader", "cache") else "right", no_wrap=True)
    for r in doc["results"]:
        peer = best_peer[r["cache"]]
        t.add_row(
            r["loader"],
            r["cache"],
            f"{r['gbps']:.2f}",
            f"{r['seconds']:.3f}",
            f"{r['gbps'] / memcpy:.2f}" if memcpy else "-",
            f"{r['gbps'] / peer:.2f}" if peer else "-",
            "-" if r.get("copied_bytes") is None else f"{r['copied_bytes'] / 1e6:.0f}",
            "yes" if r["verified"] else "NO",
        )
    console = Console()
    console.width = max(console.width, 110)  # full loader names even when piped
    console.print(t)
    for note in doc.get("notes", []):
        console.print(f"- {note}", highlight=False)


@click.command("load")
@click.option("--size-mb", type=float, default=512, show_default=True)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Write results here; the PNG goes next to it unless --plot says where.",
)
@click.option(
    "--plot",
    "png",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw ours vs the peers vs the machine's limits here (PNG).",
)
@click.option(
    "--dir",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Model dir to (re)use; default: a fresh temporary dir.",
)
@click.option("--parts", type=int, default=4, show_default=True, help="safetensors files.")
@click.option("--repeat", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=8, show_default=True, help="Preload readers.")
@click.option("--chunk-mib", type=int, default=64, show_default=True)
@click.option("--loader", "only", multiple=True, help="Only these loaders (repeatable).")
@click.option(
    "--uri",
    default=None,
    help="s3://bucket/prefix or hf://org/repo[@revision]: bench a source's cold start from S3 "
    "(weightlift vs runai vs boto3) or the Hub (weightlift vs snapshot_download) instead of "
    "local files.",
)
@click.option(
    "--endpoint",
    default=None,
    help="S3 or Hub endpoint of --uri (credentials from AWS_* env, HF_TOKEN); default: start "
    "MinIO or the local Hub API server on loopback holding a demo model of --size-mb as --uri.",
)
@click.option("--region", default=None, help="S3 region of --uri.")
def load_command(
    size_mb: float,
    json_path: Path,
    png: Path | None,
    model_dir: Path | None,
    parts: int,
    repeat: int,
    threads: int,
    chunk_mib: int,
    only: tuple[str, ...],
    uri: str | None,
    endpoint: str | None,
    region: str | None,
) -> None:
    """Load GB/s of weightlift-preload/direct vs safetensors, fastsafetensors, runai."""
    from weightlift.local.models import make_demo

    if uri is not None:
        doc = _remote_command(
            uri, endpoint, region, size_mb, parts, repeat, threads, chunk_mib, only, json_path
        )
        if png is not None:
            from weightlift.bench.charts import plot, remote_panels

            title = f"weightlift bench load: {doc['bytes'] / 1e6:.0f} MB, median of {repeat}"
            click.echo(f"wrote {plot(remote_panels(doc), title, png)}")
        return

    names = list(make_loaders(threads, chunk_mib))
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise click.BadParameter(
            f"unknown loader(s) {unknown}; known: {names}", param_hint="--loader"
        )
    loaders = [n for n in names if n in only] if only else [n for n in names if n not in OPT_IN]
    with tempfile.TemporaryDirectory(prefix="wl-bench-", dir=os.environ.get("WL_BENCH_TMP")) as tmp:
        d = model_dir or Path(tmp) / "model"
        if not (d / "model.pt2").exists() or not list(d.glob("*.safetensors")):
            click.echo(f"writing a {size_mb:.0f} MB demo model to {d} ...")
            make_demo(d, size_mb, tp=1, hook=False, parts=parts)
        files = rank_files(d, 0, 1)
        doc = bench(files, repeat, threads, chunk_mib, loaders)
    doc["command"] = (
        f"weightlift bench load --size-mb {size_mb:g} --parts {parts} --repeat {repeat} "
        f"--threads {threads} --chunk-mib {chunk_mib} --json {json_path}"
        + "".join(f" --loader {n}" for n in only)
    )
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(doc)
    png = plot_load(doc, png or json_path.with_suffix(".png"))
    click.echo(f"wrote {json_path} and {png}")
    if not all(r["verified"] for r in doc["results"]):
        raise click.ClickException("some loader's output differs from safetensors.load_file")


def plot_load(doc: dict[str, Any], png: Path) -> Path:
    from weightlift.bench.charts import load_panels, plot

    title = f"weightlift bench load: {doc['bytes'] / 1e6:.0f} MB, median of {doc['repeat']}"
    return plot(load_panels(doc), title, png)


def _remote_command(
    uri: str,
    endpoint: str | None,
    region: str | None,
    size_mb: float,
    parts: int,
    repeat: int,
    threads: int,
    chunk_mib: int,
    only: tuple[str, ...],
    json_path: Path,
) -> dict[str, Any]:
    """`--uri s3://...` or `--uri hf://...`: the store's contenders, same files, same run."""
    if uri.startswith("hf://"):
        from weightlift.bench.hfload import HF_LOADERS, print_hf_table, run_hf_bench

        known, kind, print_doc = list(HF_LOADERS), "hf", print_hf_table
    else:
        from weightlift.bench.s3load import S3_LOADERS, print_s3_table, run_s3_bench

        known, kind, print_doc = list(S3_LOADERS), "S3", print_s3_table
    unknown = sorted(set(only) - set(known))
    if unknown:
        raise click.BadParameter(
            f"unknown {kind} loader(s) {unknown}; known: {known}", param_hint="--loader"
        )
    loaders = [n for n in known if not only or n in only]
    common: dict[str, Any] = dict(
        size_mb=size_mb,
        parts=parts,
        repeat=repeat,
        threads=threads,
        chunk_mib=chunk_mib,
        loaders=loaders,
        json_path=json_path,
    )
    if kind == "hf":
        doc = run_hf_bench(uri, endpoint, **common)
    else:
        doc = run_s3_bench(uri, endpoint, region, **common)
    print_doc(doc)
    click.echo(f"wrote {json_path}")
    if not all(r["verified"] for r in doc["results"]):
        raise click.ClickException("some loader's output differs from safetensors.load_file")
    return doc
