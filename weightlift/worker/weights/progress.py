"""The load vocabulary every floor above shares: LoadError and LoadProgress."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class LoadError(RuntimeError):
    """A load failed; the message names the file/tensor/peer and what was wrong."""


@dataclass
class LoadProgress:
    """Thread-safe byte counter shared by a loader and whoever reports progress."""

    bytes_total: int = 0
    bytes_loaded: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    loaded_from: str | None = None
    # Seconds per step of the load, when the loader measures them (the P2P pull does).
    phases: dict[str, float] = field(default_factory=dict)
    # The transport UCX used for a P2P pull, in its words (p2p/ucx_proto.py), and why the pull
    # gave it up or went on slowly (a software emulation of GPU memory); kept across `reset`:
    # a storage load after such a pull still says why it happened.
    transport: str = ""
    transport_note: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_total(self, total: int) -> None:
        with self._lock:
            self.bytes_total = total

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_loaded += nbytes

    def reset(self) -> None:
        """Start over (a fallback after a failed peer transfer counts from zero)."""
        with self._lock:
            self.bytes_loaded = 0
            self.started = time.monotonic()
            self.finished = None
            self.phases = {}

    def finish(self) -> None:
        self.finished = time.monotonic()

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.bytes_loaded / s / 1e9 if s > 0 else 0.0
