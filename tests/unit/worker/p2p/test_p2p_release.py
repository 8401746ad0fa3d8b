"""A failed pull lets go of its buffer before the next candidate allocates one.

A pull held by the fault gate mid-transfer (its first READ landed) loses its source (SIGKILL),
fails, and the loader moves to the next candidate: the first pull's buffer must be gone when
the second pull allocates, so a model-sized buffer (on a GPU, the one that decides whether the
next attempt or the storage load fits) is never held for nothing. Observed with a weakref taken
at each allocation; the loader keeps every PeerFailed (to name them), which is what used to
keep the buffer alive through the exception's frames.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.p2p import Proc, needs_nixl, source_process
from weightlift.api.worker import PeerCandidate
from weightlift.local.sharded import make_plan
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.p2p import faultgate, target
from weightlift.worker.weights.progress import LoadProgress

CPU = torch.device("cpu")
OPTS = target.PullOptions(transfer_timeout_s=5, stall_seconds=3, liveness_interval_s=0.25)


@pytest.fixture
def sources(model_dir: Path, tmp_path: Path) -> Iterator[dict[str, tuple[Proc, PeerCandidate]]]:
    with (
        source_process(model_dir, tmp_path, pod="src-a") as a,
        source_process(model_dir, tmp_path, pod="src-b") as b,
    ):
        yield {"src-a": a, "src-b": b}


class Allocations:
    """Every pull buffer allocated (a weakref each) and, at each allocation, which earlier
    ones were still alive."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.alive_at: list[list[int]] = []
        original = target._Pull._new_buffer

        def new_buffer(pull: target._Pull, size: int) -> None:
            self.alive_at.append([i for i, r in enumerate(self.refs) if r() is not None])
            original(pull, size)
            assert pull.buf is not None
            self.refs.append(weakref.ref(pull.buf))

        monkeypatch.setattr(target._Pull, "_new_buffer", new_buffer)


@needs_nixl
@pytest.mark.timeout(120)
def test_a_failed_pulls_buffer_is_freed_before_the_next_is_allocated(
    gate: Path,
    model_dir: Path,
    sources: dict[str, tuple[Proc, PeerCandidate]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """~1 s beside the sources' start (~3 s)."""
    allocations = Allocations(monkeypatch)
    plan = make_plan(
        model_dir,
        pod="md-abc-1",
        role="Target",  # type: ignore[arg-type]
        peers=[cand for _, cand in sources.values()],
        identity="ident-test",
    )
    loader = PeerToPeerLoader(options=OPTS)
    out: dict[str, object] = {}

    def run() -> None:
        out["tensors"] = loader.load(plan, 0, CPU, LoadProgress())

    faultgate.arm(gate, "md")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while (held := faultgate.holding(gate, "md")) is None:
        assert thread.is_alive() and time.monotonic() < deadline, out
        time.sleep(0.01)
    assert held.in_flight and len(allocations.refs) == 1
    assert allocations.refs[0]() is not None  # the held pull's buffer, in use
    sources[held.peer][0].kill()
    faultgate.release(gate, held.pod)
    thread.join(60)
    assert not thread.is_alive()

    want = load_file(str(model_dir / "rank-0-of-2.safetensors"))
    got = out["tensors"]
    assert isinstance(got, dict) and all(torch.equal(got[k], want[k]) for k in want)
    assert [f.peer for f in loader.failures] == [held.peer]
    assert loader.last_result is not None and loader.last_result.peer_pod != held.peer
    assert len(allocations.refs) == 2
    assert allocations.alive_at[1] == [], "the failed pull's buffer outlived it"
