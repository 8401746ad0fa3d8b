"""How staged bytes reach the target buffer: a copy engine queues copies and says when they are
done. The loader must not reuse or free a staging slot (or unregister a host window) while a
copy reading it is queued; `record` marks the copies queued so far and `wait` blocks until they
are done. On CUDA the copies run on a side stream (async DMA from pinned memory) and tickets are
events; on CPU they run at once. `ThreadCopyEngine` is a really asynchronous CPU engine (its
copies run in order on its own thread), so the waits are exercised without a GPU."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class CopyEngine(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst <- src (same byte length)."""
        ...

    def record(self) -> Any:
        """A ticket for every copy queued so far."""
        ...

    def wait(self, ticket: Any) -> None:
        """Block until the copies `ticket` covers are done."""
        ...

    def synchronize(self) -> None:
        """Block until every queued copy is done."""
        ...

    def close(self) -> None: ...


class SyncCopyEngine:
    """Copies happen inside `copy` (CPU targets)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> None:
        return None

    def wait(self, ticket: Any) -> None:
        del ticket

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadCopyEngine:
    """Copies run in queue order on one thread of their own; tickets are Events. `run_copy`
    is what the thread calls per copy (tests may hold it)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wl-copy", daemon=True)
        self._thread.start()

    def run_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                job()
            except BaseException as exc:  # reported by the next wait
                self._error = exc

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._q.put(lambda: self.run_copy(dst, src))

    def record(self) -> threading.Event:
        done = threading.Event()
        self._q.put(done.set)
        return done

    def wait(self, ticket: threading.Event) -> None:
        ticket.wait()
        if self._error is not None:
            raise self._error

    def synchronize(self) -> None:
        self.wait(self.record())

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class CudaCopyEngine:
    """Copies on a side stream of `device`, non-blocking (async DMA from pinned or registered
    host memory); tickets are CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # The destination was allocated on the current stream: copy only after it.
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, ticket: torch.cuda.Event) -> None:
        ticket.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        pass


def copy_engine_for(device: torch.device) -> CopyEngine:
    return CudaCopyEngine(device) if device.type == "cuda" else SyncCopyEngine()
