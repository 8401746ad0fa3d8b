"""`weightlift bench p2p`: P2P over NIXL vs memcpy vs a storage reload, then a killed source.

One run, one host: writes an N MB model presharded for 2 ranks, starts a source process that
loads it from storage and publishes it (SourcePublisher), then a target process that pulls both
ranks (PeerToPeerLoader, ranks in parallel, every checksum verified). memcpy and a storage reload
(the worker's storage loader) are measured in the same run. Then a fresh source is SIGKILLed
after the target's first completed READ batch, and the target must fall back to storage.

With workers (the default) two more rows: targets started in standby (no peers yet, a hand-off
file: they reserve and fault in their pull buffers, then are handed the source, as a pod created
before its source is Ready), whose READs alone are held against a copy into new memory; and
Source workers loading from storage with a cold page cache, so that P2P and storage are also
compared like with like: both a worker's own loadSeconds, its program opening beside the load
(on 2 cores that opening's imports slow the manifest fetch and agent steps of a pull).

Two process modes: `--processes worker` (default) runs real `weightlift worker` processes and
reads their /weightlift/v1/status (see p2p_worker.py); `--processes peer` runs
`python -m weightlift.bench.peer serve|pull`, the loading half of a worker (the same
loader and publisher classes), which also reports READ-only GB/s and pulls several times in one
process.

What mattered when tuning on one host (2 vCPUs, UCX from the nixl-cu12 wheel):
- UCX picks cma (process_vm_readv, zero-copy, one copy in the kernel) for the READs and tcp for
  its active messages; that is the fastest set here. UCX_TLS=tcp alone moves the bytes through
  loopback sockets (~10x slower READs); the shared-memory transports (posix, sysv; "sm", "shm")
  cannot be used at all: NIXL asks for peer-failure error handling, which they lack, so
  UCX_TLS=sm/shm/cma-only fail at agent creation. Leave UCX_TLS unset or use "tcp,cma".
- NIXL's progress thread (enable_prog_thread) spins a core per agent, idle or not (~30% of a core
  each, measured); on a small host it starves the copy and the checksums. Without it the source
  must still be progressed (a READ never completes otherwise): the source polls its agents
  (get_new_notifs, 1 ms while a reader has a session, 5 ms idle) and the target's wait loop
  (check_xfer_state) drives its own. This alone made pulls ~3x faster here.
- Fresh destination memory costs page faults (~3 GB/s a thread on this VM, ~1.2 us per 4 KiB
  page; they scale with threads): faulting the buffer in with one memset before the READs beat
  letting the kernel fault it page by page inside process_vm_readv. The target starts that
  memset (target._Prefault, a thread, front to back) before the manifest fetch when the model's
  own headers give the size, and posts each READ once its memory is faulted. A/B in one
  process (256 MB, 2 ranks, 2 cores): 0.160 s pipelined vs 0.162 s fault-all-first, i.e.
  neutral here (both ranks' faulting and copies already fill the 2 cores); it pays off where
  cores are spare. In a worker, beside the program opening, it made the pull faster (median
  0.89 s vs 1.04 s, 768 MB, 3 interleaved pairs), and time to Ready was no worse: p2p target
  / storage source 1.09x with it and 1.05x without, within the runs' spread (1.02-1.16x and
  1.03-1.06x). Tried and dropped: (a) MADV_POPULATE_WRITE instead of the memset; (b)
  transparent huge pages (MADV_HUGEPAGE, 2 MiB aligned): 24 GB/s when the kernel hands back
  recently freed memory, but 0.44 GB/s on memory this VM returned to its host (virtio-balloon
  free page reporting, page_reporting_order=11), which is what a fresh process gets; on bare
  metal they would help.
- NIXL agents: `prewarm_nixl()` (target.py; the worker calls it while init hooks run) loads
  NIXL and leaves two spare agents (~10 ms each) that the ranks' pulls take; a pull hands its
  agent back instead of destroying it. The first agent of a process cost ~0.45 s here, ~0.4 s of
  it UCX's memory hooks spinning on sched_yield while patching mmap & co. (a core busy for the
  whole of it; transport.py): with no hook to feed on a host without RDMA devices, the workers
  set UCX_MEM_MMAP_HOOK_MODE=none there (`ucx_defaults` in the results) and the first agent
  takes ~0.07 s in a worker process (NIXL's libraries loading, then ~0.013 s of UCX).
- READ size: 16-256 MB per request made no measurable difference; 64 MB requests, up to
  max_in_flight (8) in flight. Checksums (xxh3: ~30 GB/s a core here, GIL released) run per
  tensor as soon as its bytes landed, overlapping the remaining READs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import torch

from weightlift.api.worker import PeerCandidate
from weightlift.bench.load import drop_cache
from weightlift.local.sharded import make_plan, write_sharded_model
from weightlift.worker.p2p.transport import rdma_devices, ucx_defaults

if TYPE_CHECKING:
    from rich.table import Table

RANKS = 2
# The fault run's target moves small, throttled READ batches: the kill lands mid-transfer.
FAULT_BATCH_MB = 4


def measure_memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Host memcpy GB/s with torch's threads (both buffers pre-faulted; median of repeats)."""
    n = max(nbytes, 64 << 20)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times) / 1e9


def measure_fresh_memcpy_gbps(nbytes: int, repeat: int = 3) -> float:
    """memcpy into freshly allocated memory (page faults included): the ceiling for any load
    that, like a target's, must land in new memory."""
    n = max(nbytes, 64 << 20)
    src = torch.ones(n, dtype=torch.uint8)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        dst = torch.empty(n, dtype=torch.uint8)
        dst.copy_(src)
        times.append(time.perf_counter() - t)
        del dst
    return n / statistics.median(times) / 1e9


def measure_storage(plan_path: Path, files: list[Path], cold: bool, repeat: int) -> dict[str, Any]:
    """Both ranks from storage with the worker's storage loader, ranks in parallel threads."""
    from weightlift.api.worker import WorkerPlan
    from weightlift.bench.peer import storage_load

    plan = WorkerPlan.from_file(plan_path)
    device = torch.device("cpu")
    runs = []
    nbytes = 0
    for _ in range(repeat):
        if cold:
            drop_cache(files)
        t = time.perf_counter()
        with ThreadPoolExecutor(RANKS) as pool:
            out = list(pool.map(lambda r: storage_load(plan, r, device), range(RANKS)))
        runs.append(time.perf_counter() - t)
        nbytes = sum(t.numel() * t.element_size() for shard in out for t in shard.values())
        del out
    seconds = statistics.median(runs)
    try:
        from weightlift.worker.loaders.strategy import choose_storage_loader

        loader = choose_storage_loader(plan, {0: device}).name
    except ImportError:
        loader = "safetensors.load_file"
    return {
        "gbps": nbytes / seconds / 1e9,
        "seconds": seconds,
        "cache": "cold" if cold else "warm",
        "loader": loader,
        "runs": runs,
    }


class _Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "weightlift.bench.peer", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )

    def events(self, timeout: float) -> Any:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.p.stdout:
            yield json.loads(line)
            if time.monotonic() > deadline:
                raise click.ClickException(f"peer process timed out after {timeout}s")
        err = self.p.stderr.read() if self.p.stderr else ""
        raise click.ClickException(f"peer process exited early: {err[-3000:]}")

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        for e in self.events(timeout):
            if e["event"] == event:
                return dict(e)
        raise AssertionError("unreachable")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=30)


def run_bench(
    size_mb: float,
    repeat: int,
    workdir: Path,
    env: dict[str, str],
    throttle_s: float,
    processes: str = "worker",
) -> dict[str, Any]:
    model = workdir / "model"
    if processes == "worker":
        from weightlift.local.models import make_demo

        files = make_demo(model, size_mb, tp=RANKS, hook=False).files
    else:
        files = [
            f
            for fs in write_sharded_model(model, size_mb=size_mb, tensor_parallel=RANKS).values()
            for f in fs
        ]
    total = sum(f.stat().st_size for f in files)
    src_plan = workdir / "source.json"
    src_plan.write_text(make_plan(model, pod="bench-src-0").model_dump_json())
    result: dict[str, Any] = {
        "model": {"size_mb": size_mb, "bytes_on_disk": total, "ranks": RANKS, "files": len(files)},
        "limits": {
            "memcpy_gbps": measure_memcpy_gbps(min(total, 1 << 30)),
            "memcpy_fresh_gbps": measure_fresh_memcpy_gbps(min(total, 1 << 30)),
        },
        "env": {k: v for k, v in env.items() if k.startswith("UCX_")},
    }
    # What each worker adds to its own environment before NIXL loads UCX (transport.py).
    result["ucx_defaults"] = ucx_defaults(env, rdma_devices())

    if processes == "worker":
        from weightlift.bench.p2p_worker import run_workers

        result.update(run_workers(model, files, workdir, env, repeat, throttle_s))
    else:
        result.update(run_peers(model, workdir, env, repeat, throttle_s, src_plan))

    # --- storage reload in the same run (cold page cache, and warm)
    result["storage"] = measure_storage(src_plan, files, cold=True, repeat=repeat)
    result["storage_warm"] = measure_storage(src_plan, files, cold=False, repeat=repeat)
    for key in ("p2p", "p2p_standby"):
        if key in result:
            _ratios(result[key], result)

    return result


def _ratios(pulls: dict[str, Any], result: dict[str, Any]) -> None:
    """A pull against the limits and the storage reload of the same run."""
    limits = result["limits"]
    pulls["ratio_to_memcpy"] = pulls["gbps"] / limits["memcpy_gbps"]
    # A target lands its bytes in memory it never touched: this is its honest ceiling...
    pulls["ratio_to_memcpy_fresh"] = pulls["gbps"] / limits["memcpy_fresh_gbps"]
    pulls["ratio_to_storage_cold"] = pulls["gbps"] / result["storage"]["gbps"]
    if "storage_worker" in result:  # like with like: both a worker's own loadSeconds
        pulls["ratio_to_storage_worker_cold"] = pulls["gbps"] / result["storage_worker"]["gbps"]
    # ...unless it waited in standby with its buffers faulted in: then the READs alone are
    # what to hold against a copy into new memory.
    transfer = pulls.get("phases", {}).get("transfer")
    if transfer and not pulls.get("transfer_gbps"):
        pulls["transfer_gbps"] = pulls["bytes"] / transfer / 1e9
    if pulls.get("transfer_gbps"):
        pulls["transfer_ratio_to_memcpy_fresh"] = (
            pulls["transfer_gbps"] / limits["memcpy_fresh_gbps"]
        )


def run_peers(
    model: Path,
    workdir: Path,
    env: dict[str, str],
    repeat: int,
    throttle_s: float,
    src_plan: Path,
) -> dict[str, Any]:
    """Source and target as `python -m weightlift.bench.peer` processes."""
    # --- p2p: source process, target process pulling both ranks `repeat` times
    source = _Proc(["serve", "--plan", str(src_plan)], env)
    try:
        ready = source.wait_for("ready", 300)
        cand = PeerCandidate(pod="bench-src-0", address=f"127.0.0.1:{ready['port']}")
        tgt_plan = workdir / "target.json"
        tgt_plan.write_text(make_plan(model, pod="bench-tgt-0", peers=[cand]).model_dump_json())
        target = _Proc(
            ["pull", "--plan", str(tgt_plan), "--repeat", str(repeat), "--check", str(model)], env
        )
        try:
            runs = _collect_runs(target)
        finally:
            target.kill()
    finally:
        source.kill()
    warm = runs[1:] or runs
    seconds = statistics.median(r["seconds"] for r in warm)
    xfer = statistics.median(
        max(rk.get("transfer_seconds", 0.0) for rk in r["ranks"]) for r in warm
    )
    nbytes = runs[0]["bytes"]
    result: dict[str, Any] = {"processes": "python -m weightlift.bench.peer serve|pull"}
    result["p2p"] = {
        "gbps": nbytes / seconds / 1e9,
        "seconds": seconds,
        "verified": all(r["ok"] for r in runs),
        "ranks": RANKS,
        "bytes": nbytes,
        "transfer_gbps": nbytes / xfer / 1e9 if xfer else None,
        "first_pull_seconds": runs[0]["seconds"],
        "runs": [r["seconds"] for r in runs],
        "from": sorted({rk["loaded_from"] for r in runs for rk in r["ranks"]}),
    }

    result["fault"] = run_fault(model, workdir, env, throttle_s)
    return result


def _collect_runs(target: _Proc) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for e in target.events(600):
        if e["event"] in ("repeat", "done"):
            runs.append(e)
            if e["event"] == "done":
                return runs
    return runs


def run_fault(model: Path, workdir: Path, env: dict[str, str], throttle_s: float) -> dict[str, Any]:
    plan = workdir / "doomed.json"
    plan.write_text(make_plan(model, pod="bench-doomed-0").model_dump_json())
    source = _Proc(["serve", "--plan", str(plan)], env)
    killed_at: float | None = None
    try:
        ready = source.wait_for("ready", 300)
        cand = PeerCandidate(pod="bench-doomed-0", address=f"127.0.0.1:{ready['port']}")
        tgt_plan = workdir / "doomed-target.json"
        tgt_plan.write_text(
            make_plan(model, pod="bench-tgt-1", peers=[cand], max_in_flight=1).model_dump_json()
        )
        target = _Proc(
            [
                *("pull", "--plan", str(tgt_plan), "--fallback", "--check", str(model)),
                *("--batch-mb", str(FAULT_BATCH_MB), "--throttle-s", str(throttle_s)),
            ],
            env,
        )
        try:
            fallbacks: list[dict[str, Any]] = []
            failures: list[str] = []
            done: dict[str, Any] = {}
            for e in target.events(600):
                if e["event"] == "batch" and killed_at is None:
                    killed_at = time.monotonic()
                    source.kill()
                elif e["event"] == "fallback":
                    fallbacks.append(e)
                elif e["event"] == "peer_failed":
                    failures.append(e["message"])
                elif e["event"] == "done":
                    done = e
                    break
        finally:
            target.kill()
    finally:
        source.kill()
    ranks = done.get("ranks", [])
    fell_back = bool(ranks) and all(r.get("fell_back") for r in ranks)
    to_fallback = (
        max(f["t"] for f in fallbacks) - killed_at if fallbacks and killed_at is not None else None
    )
    storage_done = [r["t_storage_done"] for r in ranks if "t_storage_done" in r]
    return {
        "source_killed": killed_at is not None,
        "fell_back": fell_back,
        "verified": bool(done.get("ok")) and fell_back,
        "seconds_to_fallback": to_fallback,
        "seconds_to_loaded": (max(storage_done) - killed_at)
        if storage_done and killed_at is not None
        else None,
        "loaded_from": sorted({str(r.get("loaded_from")) for r in ranks}),
        "peer_failures": failures,
        "throttle_s": throttle_s,
    }


def print_group_table(group: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="multi-pod replicas: 2 pods per replica, one rank per pod")
    for col in ("group", "pod", "ranks", "loaded from", "MB", "GB/s", "load s", "group ready s"):
        table.add_column(col)
    for kind in ("source", "target"):
        for i, pod in enumerate(group[kind]["pods"]):
            table.add_row(
                kind if i == 0 else "",
                pod["pod"],
                ",".join(str(r) for r in pod["ranks"]),
                str(pod["loadedFrom"]),
                f"{pod['bytes'] / 1e6:.1f}",
                f"{pod['gbps']:.2f}" if pod.get("gbps") else "-",
                f"{pod['loadSeconds']:.3f}" if pod.get("loadSeconds") else "-",
                f"{group[kind]['readySeconds']:.2f}" if i == 0 else "",
            )
    table.caption = (
        f"target group / source group (storage) time to Ready: {group['targetOverSource']:.2f}x "
        "(from each group's hand-off to its last pod Serving: load + torch.distributed join)"
    )
    Console().print(table)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    memcpy = result["limits"]["memcpy_gbps"]
    p2p, st, stw, fault = result["p2p"], result["storage"], result["storage_warm"], result["fault"]
    table = Table(title=f"weightlift bench p2p: {result['model']['size_mb']} MB, {RANKS} ranks")
    fresh = result["limits"]["memcpy_fresh_gbps"]
    for col in ("path", "GB/s", "x memcpy", "x memcpy new", "seconds", "verified", "note"):
        table.add_column(col)
    table.add_row(
        "memcpy (host)", f"{memcpy:.2f}", "1.00", f"{memcpy / fresh:.2f}", "", "", "torch copy_"
    )
    table.add_row(
        "memcpy into new memory",
        f"{fresh:.2f}",
        f"{fresh / memcpy:.2f}",
        "1.00",
        "",
        "",
        "page faults included",
    )
    note = "end to end (loader: setup, READs, checksums)"
    if p2p.get("transfer_gbps"):
        note += f"; READs alone {p2p['transfer_gbps']:.2f} GB/s"
    if "first_pull_seconds" in p2p:
        note += f"; first pull {p2p['first_pull_seconds']:.3f}s"
    if "runs" in p2p and p2p["runs"] and isinstance(p2p["runs"][0], dict):
        note = "target worker's loadSeconds; inference probe checked"
    table.add_row(
        "p2p NIXL READ",
        f"{p2p['gbps']:.2f}",
        f"{p2p['ratio_to_memcpy']:.2f}",
        f"{p2p['gbps'] / fresh:.2f}",
        f"{p2p['seconds']:.3f}",
        str(p2p["verified"]),
        note,
    )
    standby = result.get("p2p_standby")
    if standby:
        table.add_row(
            "p2p into standby (buffers faulted in before the hand-off)",
            f"{standby['gbps']:.2f}",
            f"{standby['ratio_to_memcpy']:.2f}",
            f"{standby['gbps'] / fresh:.2f}",
            f"{standby['seconds']:.3f}",
            str(standby["verified"]),
            f"READs alone {standby.get('transfer_gbps') or 0:.2f} GB/s = "
            f"{standby.get('transfer_ratio_to_memcpy_fresh') or 0:.2f}x memcpy into new memory",
        )
    storage_rows = [("storage (cold cache)", st), ("storage (warm cache)", stw)]
    if result.get("storage_worker"):
        storage_rows.insert(1, ("storage (cold cache), in a worker", result["storage_worker"]))
    for label, s in storage_rows:
        table.add_row(
            label,
            f"{s['gbps']:.2f}",
            f"{s['gbps'] / memcpy:.2f}",
            f"{s['gbps'] / fresh:.2f}",
            f"{s['seconds']:.3f}",
            "",
            s["loader"],
        )
    for label, pulls in (("p2p", p2p), ("p2p into standby", standby)):
        if not pulls:
            continue
        ratio = f"{pulls['ratio_to_storage_cold']:.2f}x"
        if "ratio_to_storage_worker_cold" in pulls:
            ratio += f" ({pulls['ratio_to_storage_worker_cold']:.2f}x in a worker)"
        table.add_row(
            f"{label} ÷ storage (cold)",
            ratio,
            "",
            "",
            "",
            "",
            ">= 1: a target pulls faster than it could reload from disk",
        )
        if pulls.get("phases"):
            total, steps = _breakdown(pulls["phases"])
            table.add_row(f"{label} breakdown (s)", "", "", "", f"{total:.3f}", "", steps)
    _ready_row(table, p2p, result.get("storage_worker"))
    fb = fault["seconds_to_fallback"]
    table.add_row(
        "fault: source killed",
        "",
        "",
        "",
        f"{fb:.3f}" if fb is not None else "n/a",
        str(fault["verified"]),
        f"fell back: {fault['fell_back']} → {', '.join(fault['loaded_from'])}",
    )
    Console().print(table)


def _ready_row(table: Table, p2p: dict[str, Any], storage: dict[str, Any] | None) -> None:
    """Time to Ready (process start -> Serving) of a p2p target against a storage source."""
    ready, ready_storage = p2p.get("ready_seconds"), (storage or {}).get("ready_seconds")
    if ready and ready_storage:
        table.add_row(
            "time to Ready, p2p target ÷ storage source (process start → Serving)",
            f"{ready_storage / ready:.2f}x",
            "",
            "",
            f"{ready:.3f}",
            "",
            f"storage source: {ready_storage:.3f} s; what a user waits for (>= 1: p2p sooner)",
        )


def _breakdown(phases: dict[str, float]) -> tuple[float, str]:
    """The pull's steps (and what ran beside them) as one line, with the steps' total."""
    from weightlift.worker.p2p.target import OVERLAPPED_PHASES, PULL_PHASES

    steps = ", ".join(f"{k} {phases[k]:.3f}" for k in PULL_PHASES if k in phases)
    beside = ", ".join(f"{k} {phases[k]:.3f}" for k in OVERLAPPED_PHASES if k in phases)
    if beside:
        steps += f" (beside them: {beside})"
    return sum(phases[k] for k in PULL_PHASES if k in phases), steps


@click.command("p2p")
@click.option("--size-mb", type=float, default=256.0, show_default=True, help="Model size.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write results here.")
@click.option(
    "--plot",
    "png",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the pulls vs storage vs memcpy here (PNG).",
)
@click.option(
    "--repeat", type=int, default=5, show_default=True, help="Pulls (median of all but the first)."
)
@click.option("--ucx-tls", default=None, help="UCX_TLS for both processes (default: UCX's choice).")
@click.option(
    "--throttle-s",
    type=float,
    default=0.2,
    show_default=True,
    help="Fault run: pause after each posted READ batch so the kill lands mid-transfer.",
)
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="Keep files here.")
@click.option(
    "--processes",
    type=click.Choice(["worker", "peer"]),
    default="worker",
    show_default=True,
    help="worker: real `weightlift worker` processes; peer: the loading half only "
    "(python -m weightlift.bench.peer), which also reports transfer-only GB/s.",
)
@click.option(
    "--pods-per-replica",
    type=click.Choice(["1", "2"]),
    default="1",
    show_default=True,
    help="2: add the multi-pod row (p2p_group.py): a 2-pod source group from storage, then a "
    "2-pod target group pulling rank-matched; each rank's GB/s and each group's time to Ready.",
)
@click.option(
    "--node",
    type=click.Choice(["process", "kubelet"]),
    default="process",
    show_default=True,
    help="kubelet: add the rows between real pods (p2p_node.py): the same 2-replica deployment "
    "on the real node and on the process node, with each load's GB/s, time to Ready and the UCX "
    "transport the target's reads took.",
)
def p2p_command(
    size_mb: float,
    json_path: Path | None,
    png: Path | None,
    repeat: int,
    ucx_tls: str | None,
    throttle_s: float,
    workdir: Path | None,
    processes: str,
    pods_per_replica: str,
    node: str,
) -> None:
    """P2P transfer over NIXL between two processes vs memcpy and a storage reload."""
    env = dict(os.environ)
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wl-bench-p2p-")))
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_bench(size_mb, repeat, workdir, env, throttle_s, processes)
        if pods_per_replica == "2":
            from weightlift.bench.p2p_group import run_group_row

            result["group"] = run_group_row(size_mb, workdir / "group")
        if node == "kubelet":
            from weightlift.bench.p2p_node import NODE_KINDS, node_row

            result["nodes"] = [
                node_row(kind, workdir / f"node-{kind}", size_mb, 900.0) for kind in NODE_KINDS
            ]
    print_table(result)
    if "group" in result:
        print_group_table(result["group"])
    if "nodes" in result:
        from weightlift.bench.p2p_node import print_node_table

        print_node_table(result["nodes"])
    summary = {
        "limits": result["limits"],
        "p2p": result["p2p"],
        "p2p_standby": result.get("p2p_standby"),
        "storage": result["storage"],
        "storage_worker": result.get("storage_worker"),
        "fault": result["fault"],
        "storage_warm": result["storage_warm"],
        "source_load": result.get("source_load"),
        "model": result["model"],
        "env": result["env"],
        "ucx_defaults": result["ucx_defaults"],
        "processes": result["processes"],
        "group": result.get("group"),
        "nodes": result.get("nodes"),
    }
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if png is not None:
        from weightlift.bench.charts import p2p_panels, plot

        title = f"weightlift bench p2p: {summary['model']['size_mb']:g} MB, one host"
        click.echo(f"wrote {plot(p2p_panels(summary), title, png)}")
