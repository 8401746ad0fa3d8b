"""Summaries of the operator's profile: which functions, packages and operator code paths its
CPU went to (py-spy raw stacks, or cProfile's self times)."""

from __future__ import annotations

import pstats
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
PACKAGE = re.compile(r"(?:site-packages|/lib/python3\.\d+)/(?!site-packages)(?P<pkg>[A-Za-z0-9_]+)")
ROOMS = ("operator", "api")
# Frames on every main-thread stack: they say nothing about where the time went.
ENTRY_POINTS = {"<module>", "operator_command", "main"}


def _room(file: str) -> str | None:
    if "site-packages" in file or "/lib/python3." in file:
        return None
    return next((room for room in ROOMS if f"/{room}/" in file), None)


def package_of(file: str) -> str:
    room = _room(file)
    if room is not None:
        return f"weightlift.{room}"
    match = PACKAGE.search(file)
    return match.group("pkg") if match else "other"


def _short(func: str, file: str) -> str:
    room = _room(file)
    if room is not None:
        return f"{func} (weightlift/{room}/{file.rsplit(f'/{room}/', 1)[1]})"
    match = PACKAGE.search(file)
    return f"{func} ({file[match.start('pkg') :] if match else file})"


Profile = tuple[Counter[str], Counter[str], Counter[str], int]


def _pyspy(path: Path) -> Profile:
    """py-spy `record --format raw --full-filenames`: 'frame;...;leaf count' per stack."""
    own: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [m for m in (FRAME.match(f) for f in stack.split(";")) if m]
        if not frames:
            continue
        leaf = frames[-1]
        own[_short(leaf["func"], leaf["file"])] += count
        packages[package_of(leaf["file"])] += count
        # Inclusive: each operator function once per sample it is on the stack of.
        ours_on_stack = {
            _short(f["func"], f["file"])
            for f in frames
            if _room(f["file"]) and f["func"] not in ENTRY_POINTS
        }
        for name in ours_on_stack:
            ours[name] += count
    return own, packages, ours, total


def _cprofile(path: Path) -> Profile:
    stats = pstats.Stats(str(path))
    own: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    entries = stats.stats  # type: ignore[attr-defined]
    for (file, _line, func), (_cc, _nc, tottime, cumtime, _callers) in entries.items():
        own[_short(func, file)] += int(tottime * 1e6)
        packages[package_of(file)] += int(tottime * 1e6)
        if _room(file) and func not in ENTRY_POINTS:
            ours[_short(func, file)] += int(cumtime * 1e6)  # wall time for coroutines
    return own, packages, ours, sum(own.values())


def top_functions(path: Path, profiler: str, count: int = 15) -> list[tuple[str, float]]:
    """[(name, % of samples)]: top functions by self time, then self time per package
    ([pkg]), then operator functions by inclusive time (<fn>)."""
    if not path.exists():
        return [(f"(no profile written at {path})", 0.0)]
    own, packages, ours, total = _pyspy(path) if profiler == "py-spy" else _cprofile(path)
    if not total:
        return []
    rows = [(name, 100 * n / total) for name, n in own.most_common(count)]
    rows += [(f"[{pkg}]", 100 * n / total) for pkg, n in packages.most_common(10)]
    rows += [(f"<{name}>", 100 * n / total) for name, n in ours.most_common(12)]
    return rows
