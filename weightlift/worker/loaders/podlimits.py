"""The pod's CPU and memory limits as the kernel enforces them (cgroup v2), for sizing reader
threads and the pinned staging pool. A pod sees its own cgroup at /sys/fs/cgroup (cgroup
namespace); outside a container the same files describe the session's cgroup, or are absent."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Reader threads: at least this many even on one CPU (cold reads wait on the disk, not a core:
# 16 threads beat 8 on an H200 host's NVMe), at most this many (more only contend).
MIN_READERS = 4
MAX_READERS = 64


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup may use (cpu.max quota / period), or None when unlimited or unknown."""
    raw = _read(root / "cpu.max")
    if raw is None:
        return None
    parts = raw.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """Whole CPUs this process may run on: the cgroup's quota (rounded up) where it is set and
    below the CPUs it is pinned to (sched_getaffinity), else those CPUs."""
    try:
        pinned = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        pinned = os.cpu_count() or 1
    limit = cpu_limit(root)
    if limit is None:
        return max(1, pinned)
    return max(1, min(pinned, math.ceil(limit)))


def reader_threads(root: Path = CGROUP_ROOT) -> int:
    """Preload's reader threads when the plan sets none: one per usable CPU, clamped to
    [MIN_READERS, MAX_READERS]."""
    return min(MAX_READERS, max(MIN_READERS, usable_cpus(root)))


def memory_limit(root: Path = CGROUP_ROOT, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes the pod may hold: cgroup v2 memory.max where set, else the host's MemTotal (0 when
    neither is readable)."""
    raw = _read(root / "memory.max")
    if raw is not None and raw != "max":
        try:
            return int(raw)
        except ValueError:
            pass
    text = _read(meminfo) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0
