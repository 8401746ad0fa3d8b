"""Import NIXL whichever wheel provides it.

PyPI has a meta package `nixl` (import name `nixl`) and the CUDA-specific wheels `nixl-cu12` /
`nixl-cu13` whose import names are `nixl_cu12` / `nixl_cu13`; the meta package only re-exports one
of them. We depend on `nixl-cu12` directly (it bundles UCX and runs on CPU-only hosts too) and
accept any of the three here.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import weakref
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from weightlift.worker.p2p.transport import (
    AGENT_UCX_OPTIONS,
    apply_ucx_defaults,
    transport_warning,
    ucx_backend_params,
)
from weightlift.worker.p2p.ucx_proto import proto_options, record_dir

log = logging.getLogger(__name__)

_CANDIDATES = ("nixl_cu12", "nixl_cu13", "nixl._api", "nixl")


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported here; the message says what was tried and why it failed."""


@cache
def _load() -> tuple[ModuleType | None, str]:
    _quiet_logging()
    # Before the import: UCX reads its settings when NIXL's UCX plugin first loads it.
    added = apply_ucx_defaults(os.environ)
    if added:
        log.debug("no RDMA devices: UCX defaults %s (a UCX_* variable you set wins)", added)
    errors: list[str] = []
    for name in _CANDIDATES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or an OSError from a missing shared library
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            warning = transport_warning(os.environ)
            if warning:
                log.warning("%s", warning)
            return module, ""
        errors.append(f"{name}: has no nixl_agent")
    return None, "; ".join(errors)


def nixl() -> ModuleType:
    """The NIXL module (with `nixl_agent`, `nixl_agent_config`), or raise NixlUnavailable."""
    module, why = _load()
    if module is None:
        raise NixlUnavailable(f"NIXL is not importable (pip install nixl-cu12): {why}")
    return module


def nixl_import_error() -> str | None:
    """None when NIXL imports; otherwise why not (for pytest skip reasons)."""
    module, why = _load()
    return None if module is not None else why


# agent -> the directory its UCX records its READ protocols in (ucx_proto.py).
_PROTO_DIRS: weakref.WeakKeyDictionary[Any, Path] = weakref.WeakKeyDictionary()


def new_agent(
    name: str, *, record_reads: bool = False, ucx_options: Mapping[str, str] | None = None
) -> Any:
    """A NIXL agent with its own UCX backend: the one place source and target agents are made.

    No progress thread (whoever owns the agent drives it: NIXL's thread spins a core per agent,
    even idle). The UCX backend is created by us rather than by the config's `backends` so it
    gets this agent's UCX options (transport.AGENT_UCX_OPTIONS) and NIXL's `peer` error
    handling. `record_reads`: UCX writes the protocols it picks for this agent's READs to a
    directory of its own (`proto_dir`), removed with the agent. `ucx_options`: more UCX
    options for this agent only (benchmarks and tests comparing transports)."""
    mod = nixl()
    agent = mod.nixl_agent(name, mod.nixl_agent_config(enable_prog_thread=False, backends=[]))
    options = {**AGENT_UCX_OPTIONS, **(ucx_options or {})}
    directory = record_dir() if record_reads else None
    if directory is not None:
        options |= proto_options(directory)
        _PROTO_DIRS[agent] = directory
        weakref.finalize(agent, shutil.rmtree, directory, True)
    return _with_backend(agent, options)


def _with_backend(agent: Any, options: dict[str, str]) -> Any:
    agent.create_backend("UCX", ucx_backend_params(options))
    return agent


def proto_dir(agent: Any) -> Path | None:
    """Where UCX records this agent's READ protocols; None if it was made without."""
    return _PROTO_DIRS.get(agent)


def _quiet_logging() -> None:
    # NIXL logs every agent creation at INFO to stderr; keep warnings and errors.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
