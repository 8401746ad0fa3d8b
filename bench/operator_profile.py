"""Summaries of the operator's profile: which functions and which packages its CPU went to."""

from __future__ import annotations

import pstats
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
PACKAGE = re.compile(r"(?:site-packages|python3\.\d+)/(?P<pkg>[A-Za-z0-9_]+)")


def _short(file: str) -> str:
    """site-packages/kopf/_core/x.py -> kopf/_core/x.py; our modules keep their room path."""
    for marker in ("site-packages/", "lib/python3."):
        if marker in file:
            tail = file.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker.startswith("lib/") and "/" in tail else tail
    for room in ("/operator/", "/api/", "/bench/"):
        if room in file:
            return "weightlift" + room + file.split(room, 1)[1]
    return file


def package_of(file: str) -> str:
    for room in ("operator", "api"):
        if f"/{room}/" in file and "site-packages" not in file:
            return f"weightlift.{room}"
    match = PACKAGE.search(file)
    return match.group("pkg") if match else "other"


def _pyspy(path: Path) -> tuple[Counter[str], Counter[str], int]:
    """py-spy `--format raw`: one 'frame;frame;...;leaf count' line per distinct stack."""
    own: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        match = FRAME.match(frames[-1])
        leaf = f"{match['func']} ({_short(match['file'])})" if match else frames[-1]
        own[leaf] += count
        seen = set()
        for frame in frames:
            m = FRAME.match(frame)
            if m:
                seen.add(package_of(m["file"]))
        for pkg in seen:  # inclusive: a package counts once per sample it is on the stack of
            packages[pkg] += count
    return own, packages, total


def _cprofile(path: Path) -> tuple[Counter[str], Counter[str], int]:
    stats = pstats.Stats(str(path))
    own: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    entries = stats.stats  # type: ignore[attr-defined]
    for (file, line, func), (_cc, _nc, tottime, _ct, _callers) in entries.items():
        micros = int(tottime * 1e6)
        own[f"{func} ({_short(file)}:{line})"] += micros
        packages[package_of(file)] += micros  # self time per package (cProfile has no stacks)
    return own, packages, sum(own.values())


def top_functions(path: Path, profiler: str, count: int = 20) -> list[tuple[str, float]]:
    """[(name, % of samples)]: the top functions by self time, then packages (marked [pkg])."""
    if not path.exists():
        return [(f"(no profile written at {path})", 0.0)]
    own, packages, total = _pyspy(path) if profiler == "py-spy" else _cprofile(path)
    if not total:
        return []
    rows = [(name, 100 * n / total) for name, n in own.most_common(count)]
    rows += [(f"[{pkg}]", 100 * n / total) for pkg, n in packages.most_common(12)]
    return rows
