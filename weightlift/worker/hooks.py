"""Init hooks (the Triton PyTorch backend's MODEL_INIT_LIBRARY).

Before the model package is loaded, for each device the process drives: dlopen the library,
call `void* triton_pytorch_model_init(const char* model_dir, int device_index)` and keep the
handle. On shutdown call the optional `void triton_pytorch_model_release(void*)` with each
handle, then dlclose. Fail closed: a missing/unloadable library or a missing init symbol is a
HookError naming the library, the symbol and the model dir (permanent: retrying cannot help).
A NULL handle is a valid result (a library with no per-device state); release gets it back.
The device index is pod-local: the index among the GPUs the pod sees of the device the rank
drives, not the rank's number (a pod holding ranks 2 and 3 of a group calls init with 0 and 1;
a pod holding every rank, its i-th rank drives device i). vLLM and Triton rank processes pass
the device their rank process drives (`local_device_index`).
"""

from __future__ import annotations

import _ctypes
import ctypes
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from weightlift.api.model import InitHooks
from weightlift.api.worker import HookReport
from weightlift.worker.weights.progress import LoadError

log = logging.getLogger(__name__)

INIT_SYMBOL = "triton_pytorch_model_init"
RELEASE_SYMBOL = "triton_pytorch_model_release"


class HookError(LoadError):
    """An init hook could not run; `permanent` when retrying cannot help."""

    def __init__(self, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


def resolve_library(library: str, model_dir: str | Path, allow_outside: bool = False) -> Path:
    """Relative paths resolve inside the model dir; escaping it (`..`, symlinks) is refused."""
    root = Path(model_dir).resolve()
    raw = Path(library)
    candidate = raw if raw.is_absolute() else root / raw
    resolved = candidate.resolve()
    if not allow_outside and not resolved.is_relative_to(root):
        raise HookError(
            f"init hook library {library!r} resolves to {resolved}, outside the model dir "
            f"{root}; refused (set initHooks.allowOutsideModelDir for trusted images)"
        )
    if not resolved.is_file():
        raise HookError(
            f"init hook library {library!r} not found at {resolved} "
            f"(symbol {INIT_SYMBOL}, model dir {root})"
        )
    return resolved


@dataclass
class InitHookSession:
    """The loaded library and one handle per device; `release()` is idempotent."""

    library: Path
    model_dir: str
    cdll: ctypes.CDLL | None = None
    handles: dict[int, int | None] = field(default_factory=dict)
    reports: list[HookReport] = field(default_factory=list)
    released: bool = False

    def release(self) -> list[str]:
        """Call the release hook for each handle, then dlclose. Returns problems (not raised)."""
        problems: list[str] = []
        if self.released or self.cdll is None:
            self.released = True
            return problems
        self.released = True
        release = getattr(self.cdll, RELEASE_SYMBOL, None) if self._has(RELEASE_SYMBOL) else None
        if release is not None:
            release.argtypes = [ctypes.c_void_p]
            release.restype = None
            for dev, handle in self.handles.items():
                try:
                    release(handle)
                except Exception as exc:  # ctypes errors only; a C crash cannot be caught
                    problems.append(f"{RELEASE_SYMBOL} failed for device {dev}: {exc}")
        try:
            _ctypes.dlclose(self.cdll._handle)
        except OSError as exc:
            problems.append(f"dlclose({self.library}) failed: {exc}")
        self.cdll = None
        return problems

    def _has(self, symbol: str) -> bool:
        try:
            assert self.cdll is not None
            getattr(self.cdll, symbol)
            return True
        except AttributeError:
            return False


def local_device_index(rank: int) -> int:
    """The pod-local device index of a rank process (vLLM, Triton): the CUDA device it drives
    where CUDA is up in it (vLLM sets it before loading), else the rank's number (CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return rank


def run_init_hooks(hooks: InitHooks, model_dir: str, device_indices: list[int]) -> InitHookSession:
    """dlopen + init per device. Raises HookError (fail-closed) when `hooks.required`;
    otherwise failures are only reported (ok=False) and the load goes on."""
    lib_name = hooks.library
    session = InitHookSession(library=Path(lib_name), model_dir=model_dir)
    try:
        path = resolve_library(lib_name, model_dir, hooks.allow_outside_model_dir)
        session.library = path
        try:
            cdll = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            raise HookError(
                f"cannot load init hook library {path} (model dir {model_dir}): {exc}"
            ) from None
        session.cdll = cdll
        try:
            init = getattr(cdll, INIT_SYMBOL)
        except AttributeError:
            raise HookError(
                f"init hook library {path} lacks symbol {INIT_SYMBOL} (model dir {model_dir})"
            ) from None
        init.argtypes = [ctypes.c_char_p, ctypes.c_int]
        init.restype = ctypes.c_void_p
        for dev in device_indices:
            handle = init(os.fsencode(model_dir), dev)
            session.handles[dev] = handle
            session.reports.append(HookReport(library=str(path), device_index=dev, ok=True))
            log.info("init hook %s(%s, %d) -> %s", INIT_SYMBOL, model_dir, dev, handle)
    except HookError as exc:
        problems = session.release()
        if hooks.required:
            if problems:
                raise HookError(f"{exc}; while cleaning up: {'; '.join(problems)}") from None
            raise
        log.warning("optional init hook skipped: %s", exc)
        session.reports = [
            HookReport(library=str(session.library), device_index=d, ok=False, message=str(exc))
            for d in device_indices
        ]
    return session
