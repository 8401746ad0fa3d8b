"""Small process entry points around the p2p pieces, for tests and `weightlift bench p2p`.

  python -m weightlift.bench.peer serve --plan PLAN.json [--port 0] [--device cpu|cuda]
      loads the plan's ranks from storage, publishes them (SourcePublisher) on an aiohttp server
      that forwards /weightlift/v1/p2p/ like the worker's, prints {"event": "ready", "port": ..}.
  python -m weightlift.bench.peer pull --plan PLAN.json [--fallback] [--check]
        [--batch-mb MB] [--throttle-s S] [--device cpu|cuda]
      pulls the plan's ranks with PeerToPeerLoader (ranks in parallel threads; --batch-mb and
      --throttle-s set its READ size and a pause after each batch, a slow link), optionally falls
      back to storage on LoadError like the worker does, and prints JSON events (one a line):
      batch, peer_failed, fallback, rank_done, done. Timestamps are time.monotonic(), which is
      one clock for every process on the host.
  --device cuda: each rank on the host's GPU (rank r on cuda:r mod the GPUs), as a worker with
  device "cuda" places them; the pull then lands in VRAM and the source publishes VRAM.

These stand in for `weightlift worker` processes where a test needs only the loading half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from weightlift.api.worker import WorkerPlan
from weightlift.worker.loaders.p2p import DEFAULT_BATCH_BYTES, PeerToPeerLoader, options_for
from weightlift.worker.loaders.strategy import choose_storage_loader
from weightlift.worker.p2p.source import SourcePublisher, p2p_app
from weightlift.worker.p2p.target import PullOptions, prewarm_nixl
from weightlift.worker.weights.progress import LoadError, LoadProgress

_print_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()


def rank_device(kind: str, rank: int) -> torch.device:
    """Where rank `rank` lives: the CPU, or one of this host's GPUs."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def storage_load(plan: WorkerPlan, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The worker's storage loader (Preload or Direct, chosen as the worker chooses)."""
    loader = choose_storage_loader(plan, {rank: device})
    return loader.load(plan, rank, device, LoadProgress())


def reference(model_dir: Path, rank: int, tp: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from weightlift.worker.weights.files import rank_files

    out: dict[str, torch.Tensor] = {}
    for f in rank_files(model_dir, rank, tp):  # the files the loaders read, whatever their names
        out.update(load_file(str(f)))
    return out


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        xb, yb = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        if not torch.equal(xb.to(yb.device), yb):
            return False
    return True


# ------------------------------------------------------------------------------------ serve
async def _serve(plan: WorkerPlan, host: str, port: int, device: str = "cpu") -> None:
    t0 = time.monotonic()
    tensors = {r: storage_load(plan, r, rank_device(device, r)) for r in plan.ranks}
    loaded = time.monotonic() - t0
    publisher = await asyncio.to_thread(SourcePublisher, plan, tensors)
    app = p2p_app(publisher)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    emit(
        "ready",
        port=bound,
        load_seconds=loaded,
        publish_seconds=time.monotonic() - t0 - loaded,
        agents={r: s.agent_name for r, s in publisher.ranks.items()},
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    publisher.close()


# ------------------------------------------------------------------------------------- pull
def _pull_rank(
    plan: WorkerPlan,
    rank: int,
    opts: PullOptions,
    fallback: bool,
    check: Path | None,
    device_kind: str = "cpu",
) -> dict[str, Any]:
    device = rank_device(device_kind, rank)
    progress = LoadProgress()
    loader = PeerToPeerLoader(
        options=opts,
        on_batch=lambda done, total: emit("batch", rank=rank, done=done, total=total),
    )
    t0 = time.monotonic()
    result: dict[str, Any] = {"rank": rank}
    try:
        tensors = loader.load(plan, rank, device, progress)
        result.update(loaded_from=progress.loaded_from, fell_back=False)
    except LoadError as exc:
        for f in loader.failures:
            emit("peer_failed", rank=rank, peer=f.peer, kind=f.kind, message=str(f))
        emit("fallback", rank=rank, message=str(exc))
        result.update(load_error=str(exc), fell_back=True, t_fallback=time.monotonic())
        if not fallback:
            result.update(loaded_from=None, seconds=time.monotonic() - t0, verified=False)
            return result
        tensors = storage_load(plan, rank, device)
        result.update(loaded_from="storage", t_storage_done=time.monotonic())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.monotonic() - t0
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    result.update(seconds=seconds, t_loaded=time.monotonic(), bytes=nbytes, tensors=len(tensors))
    if loader.last_result is not None and not result["fell_back"]:
        result.update(transfer_seconds=loader.last_result.transfer_seconds)
        result.update(timings=loader.last_result.timings)
        result.update(phases={**loader.last_result.phases(), **loader.last_result.overlapped()})
        result.update(transport=loader.last_result.transport)
    if check is not None:
        result["verified"] = bit_equal(tensors, reference(check, rank, plan.tensor_parallel))
    else:
        # The p2p path verified every checksum; a storage load is trusted.
        result["verified"] = True
    return result


def _pull(
    plan: WorkerPlan,
    opts: PullOptions,
    fallback: bool,
    check: Path | None,
    repeat: int = 1,
    device: str = "cpu",
) -> int:
    # What a target worker does while its init hooks run: load NIXL's libraries once.
    prewarm_nixl().join(timeout=30)
    ok = True
    for i in range(repeat):
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(plan.ranks)) as pool:
            results = list(
                pool.map(lambda r: _pull_rank(plan, r, opts, fallback, check, device), plan.ranks)
            )
        # Load time: until the last rank had its weights (the optional --check is not counted).
        seconds = max(r.get("t_loaded", t0) for r in results) - t0
        nbytes = sum(r.get("bytes", 0) for r in results)
        ok = ok and all(r.get("verified") for r in results)
        emit(
            "done" if i == repeat - 1 else "repeat",
            index=i,
            seconds=seconds,
            bytes=nbytes,
            gbps=nbytes / seconds / 1e9 if seconds else 0.0,
            ranks=results,
            ok=all(r.get("verified") for r in results),
        )
        del results
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightlift.bench.peer")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--plan", type=Path, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p = sub.add_parser("pull")
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--fallback", action="store_true", help="load from storage on LoadError")
    p.add_argument("--repeat", type=int, default=1, help="pull this many times")
    p.add_argument(
        "--check", type=Path, metavar="MODEL_DIR", help="compare with load_file of these files"
    )
    p.add_argument("--batch-mb", type=float, default=DEFAULT_BATCH_BYTES / (1 << 20))
    p.add_argument("--throttle-s", type=float, default=0.0, help="pause after each READ batch")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    plan = WorkerPlan.from_file(args.plan)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.cmd == "serve":
        asyncio.run(_serve(plan, args.host, args.port, args.device))
        return 0
    opts = options_for(plan, batch_bytes=int(args.batch_mb * (1 << 20)), throttle_s=args.throttle_s)
    return _pull(plan, opts, args.fallback, args.check, args.repeat, args.device)


if __name__ == "__main__":
    raise SystemExit(main())
