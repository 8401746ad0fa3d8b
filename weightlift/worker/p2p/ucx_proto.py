"""The transport UCX used for our READs, as UCX itself records it.

UCX chooses a protocol per kind of operation (a GET into host or GPU memory, from host or GPU
memory) the first time one is issued, and with `PROTO_INFO_DIR` set it writes each choice to a
file in that directory: `<context> <ep config>_get(multi) into <mem> memory from <mem>_<range>.dot`,
whose first node says what was chosen, e.g. "zero-copy\\ncma/memory", "zero-copy\\ncuda_ipc/cuda"
or "software emulation\\ntcp/lo". Both settings are UCX context options, so each NIXL agent gets
its own directory through its UCX engine_config (nixl_compat.new_agent). `PROTO_INFO` is a glob
over the operation: "get*" matches the names the files use ("get(multi) into ...") but not the
descriptions UCX's log table uses ("remote memory read by ucp_get*..."), so UCX writes the files
and prints nothing. What we report is those words, never a guess from the memory types.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Operations UCX records: READs (ucp_get) only; see the module docstring.
READ_GLOB = "get*"
# NIXL memory type -> UCX's memory type name (ucs_memory_type_names).
UCX_MEMORY = {"DRAM": "host", "VRAM": "cuda"}
# UCX's description of a protocol that emulates RMA over active messages (ucp/rma/rma.h).
EMULATION = "software emulation"

_LABEL = re.compile(r'label="([^"\\]*)\\n([^"]*)"')
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+)([KMGT]?)$")


@dataclass(frozen=True)
class ReadTransport:
    """UCX's words for one READ protocol: `description` (zero-copy, software emulation, ...)
    and `config` (transport/device per lane: cma/memory, cuda_ipc/cuda, rc_mlx5/mlx5_0:1)."""

    description: str
    config: str

    @property
    def emulated(self) -> bool:
        return EMULATION in self.description

    def __str__(self) -> str:
        return f"{self.config} ({self.description})"


# <tmp>/wl-ucx-proto-<pid>/<one dir per agent>: a process's records in one place, removed by
# the next process that finds the pid gone (a worker killed or ended by os._exit never runs
# its own clean-up; in a pod /tmp goes with the pod anyway).
_ROOT_PREFIX = "wl-ucx-proto-"
_roots: dict[int, Path] = {}
_roots_lock = threading.Lock()


def record_dir() -> Path | None:
    """A fresh directory for one agent's records; None (said once in the log) when no temp
    dir is writable or its path would not pass through engine_config (a comma)."""
    pid = os.getpid()
    with _roots_lock:
        root = _roots.get(pid)
        try:
            if root is None:
                tmp = Path(tempfile.gettempdir())
                _sweep(tmp)
                root = tmp / f"{_ROOT_PREFIX}{pid}"
                root.mkdir(mode=0o700, exist_ok=True)
                _roots[pid] = root
                atexit.register(_remove_own, root, pid)
            directory = Path(tempfile.mkdtemp(dir=root))
        except OSError as exc:
            log.warning("cannot record UCX's READ protocols (%s): transports unreported", exc)
            return None
    if "," in str(directory):  # engine_config splits on commas
        log.warning("%s has a comma: UCX's transports go unreported", directory)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    return directory


def _remove_own(root: Path, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits this hook, not the directory
        shutil.rmtree(root, ignore_errors=True)


def _sweep(tmp: Path) -> None:
    """Remove the record roots of processes that no longer exist."""
    for root in tmp.glob(f"{_ROOT_PREFIX}*"):
        pid = root.name.removeprefix(_ROOT_PREFIX)
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(root, ignore_errors=True)
        except OSError:
            continue  # alive (another user's): not ours to remove


def proto_options(directory: Path) -> dict[str, str]:
    """UCX context options that make UCX record its READ protocols in `directory`."""
    return {"PROTO_INFO": READ_GLOB, "PROTO_INFO_DIR": str(directory)}


def _size(text: str) -> int | None:
    if text == "inf":
        return None
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a UCX size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _covers(name: str, nbytes: int) -> bool:
    """Whether the range at the end of a file name (`..._<start>_<end>.dot`) holds nbytes."""
    parts = name.removesuffix(".dot").rsplit("_", 2)
    try:
        start, end = _size(parts[-2]), _size(parts[-1])
    except (ValueError, IndexError):
        return False
    return (start or 0) <= nbytes and (end is None or nbytes <= end)


def recorded(directory: Path) -> set[str]:
    """The file names UCX has written to `directory` so far."""
    try:
        return {p.name for p in directory.iterdir() if p.suffix == ".dot"}
    except OSError:
        return set()


def read_transports(
    directory: Path,
    *,
    local_mem: str,
    remote_mem: str,
    nbytes: int,
    names: set[str] | None = None,
) -> list[ReadTransport]:
    """The protocols UCX recorded for a READ of `nbytes` into `local_mem` from `remote_mem`
    (NIXL's DRAM/VRAM), among `names` (default: every file): one per endpoint configuration,
    distinct, sorted; empty when UCX recorded none."""
    into, source = f"_into_{UCX_MEMORY[local_mem]}", f"_from_{UCX_MEMORY[remote_mem]}"
    found: set[ReadTransport] = set()
    for name in sorted(recorded(directory) if names is None else names):
        if "_get_" not in name or into not in name or source not in name:
            continue
        if not _covers(name, nbytes):
            continue
        try:
            text = (directory / name).read_text(errors="replace")
        except OSError:
            continue
        m = _LABEL.search(text)
        if m is not None:
            found.add(ReadTransport(description=m.group(1), config=m.group(2)))
    return sorted(found, key=str)
