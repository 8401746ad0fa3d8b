"""Destination buffers allocated and faulted in before the pull: what a Target in standby does
while it waits for peers, so the pull spends no time on page faults (on a VM, fresh memory costs
~1 GB/s a thread to fault in). `pull_from_peer` takes a buffer reserved for its device and size;
any other buffer is allocated there as before. Each buffer serves one pull; ranks that share a
device and a size (every rank of a CPU pod, most often) each reserve and take their own.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_reserved: dict[tuple[str, int], list[torch.Tensor]] = {}


def reserve(device: torch.device, nbytes: int) -> torch.Tensor:
    """Allocate `nbytes` on `device` and touch every page (zeroed); kept until taken."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    buf.zero_()
    with _lock:
        _reserved.setdefault((str(device), buf.numel()), []).append(buf)
    return buf


def take(device: torch.device, nbytes: int) -> torch.Tensor | None:
    """A buffer reserved for exactly this device and size, once; None if there is none."""
    with _lock:
        buffers = _reserved.get((str(device), max(nbytes, 1)))
        return buffers.pop() if buffers else None


def release() -> int:
    """Drop every reserved buffer (the Target loads from storage after all); bytes freed."""
    with _lock:
        freed = sum(b.numel() for buffers in _reserved.values() for b in buffers)
        _reserved.clear()
    return freed
