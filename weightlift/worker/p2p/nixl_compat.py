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
from functools import cache
from types import ModuleType

from weightlift.worker.p2p.transport import apply_ucx_defaults, transport_warning

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


def _quiet_logging() -> None:
    # NIXL logs every agent creation at INFO to stderr; keep warnings and errors.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
