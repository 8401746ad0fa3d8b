"""Run a Python module under tracemalloc and keep the snapshot of its largest heap.

`python -m weightlift.bench.memtrace OUT MODULE [ARGS...]` runs MODULE as `python -m` would;
tracing starts once the imports are done (tracing them made kopf's import take minutes on a busy
machine, and they are the same at any scale); a thread then checks the traced heap every few
seconds and, whenever it grew by a tenth over the last snapshot, dumps a fresh snapshot to OUT.
`bench operator --profile tracemalloc` uses it to show where the operator's memory goes at its
peak (tracemalloc sees Python allocations only: glibc arenas and thread stacks show in RSS, not
here).
"""

from __future__ import annotations

import runpy
import sys
import threading
import tracemalloc
from collections import Counter
from pathlib import Path

FRAMES = 8
CHECK_SECONDS = 5.0
START_AFTER_SECONDS = 15.0


def _watch(out: Path, stop: threading.Event) -> None:
    if stop.wait(START_AFTER_SECONDS):
        return
    tracemalloc.start(FRAMES)
    dumped = 0
    while not stop.wait(CHECK_SECONDS):
        current, _peak = tracemalloc.get_traced_memory()
        if current > dumped * 1.1:
            tracemalloc.take_snapshot().dump(str(out))
            dumped = current


def summary(path: Path, count: int = 25) -> list[tuple[str, float]]:
    """[(where, MB)]: the snapshot's biggest allocation sites (file:line), then the biggest
    sites by the first frame of ours or of a library that is not the stdlib."""
    snapshot = tracemalloc.Snapshot.load(str(path))
    rows = [
        (f"{s.traceback[0].filename}:{s.traceback[0].lineno}", s.size / 2**20)
        for s in snapshot.statistics("lineno")[:count]
    ]
    owners: Counter[str] = Counter()
    for trace in snapshot.traces:
        owners[_owner(trace.traceback)] += trace.size
    rows.append(("-- by first non-stdlib frame --", 0.0))
    rows += [(where, size / 2**20) for where, size in owners.most_common(count)]
    total = sum(t.size for t in snapshot.traces) / 2**20
    rows.append(("total traced", total))
    return rows


def _owner(traceback: tracemalloc.Traceback) -> str:
    """The innermost frame in site-packages or our code (the allocation's real owner)."""
    for frame in reversed(traceback):  # iterated oldest first: start at the allocation
        name = frame.filename
        if "site-packages" in name or "/weightlift/" in name or "/wt-" in name:
            return f"{name.split('site-packages/')[-1]}:{frame.lineno}"
    return f"{traceback[-1].filename}:{traceback[-1].lineno}"


def main() -> None:
    out, module, *args = sys.argv[1:]
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(Path(out), stop), daemon=True)
    watcher.start()
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        stop.set()


if __name__ == "__main__":
    main()
