"""The pipelined pull: READs land only in memory the prefault thread has already faulted in,
every tensor is still verified, and a corrupted byte in the last chunk is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from tests.support.p2p import ThreadSource, needs_nixl
from weightlift.local.sharded import make_plan
from weightlift.worker.loaders.p2p import PeerToPeerLoader
from weightlift.worker.p2p import target
from weightlift.worker.p2p.target import OVERLAPPED_PHASES, PULL_PHASES, PullOptions
from weightlift.worker.weights.progress import LoadError, LoadProgress

pytestmark = [needs_nixl, pytest.mark.timeout(120)]
CPU = torch.device("cpu")
# Small READs and a small prefault step: many batches, each gated on the prefault.
PIPELINED = PullOptions(
    transfer_timeout_s=5,
    stall_seconds=3,
    liveness_interval_s=0.25,
    batch_bytes=128 << 10,
    chunk_bytes=128 << 10,
    prefault_chunk_bytes=64 << 10,
)


class RecordingPrefault(target._Prefault):
    """Records, for every READ the pull was allowed to post, its end and the faulted prefix."""

    posted: ClassVar[list[tuple[int, int]]] = []

    def ready(self, end: int) -> bool:
        ok = super().ready(end)
        if ok:
            RecordingPrefault.posted.append((end, self._faulted))
        return ok


def reference(model_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / f"rank-{rank}-of-2.safetensors"))


@pytest.fixture
def source(model_dir: Path) -> Iterator[ThreadSource]:
    src = ThreadSource(
        make_plan(model_dir, pod="src-p"), {r: reference(model_dir, r) for r in (0, 1)}
    )
    yield src
    src.close()


def test_reads_land_only_in_faulted_memory(
    model_dir: Path, source: ThreadSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(target, "_Prefault", RecordingPrefault)
    RecordingPrefault.posted = []
    plan = make_plan(model_dir, pod="tgt-p", role="Target", peers=[source.candidate])
    loader = PeerToPeerLoader(options=PIPELINED)
    progress = LoadProgress()
    got = loader.load(plan, 0, CPU, progress)

    want = reference(model_dir, 0)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    result = loader.last_result
    assert result is not None and result.batches > 4
    # Every batch was posted through the gate, and only into the faulted prefix.
    assert len(RecordingPrefault.posted) >= result.batches
    assert all(end <= faulted for end, faulted in RecordingPrefault.posted)
    assert max(end for end, _ in RecordingPrefault.posted) >= result.nbytes
    # The report keeps consecutive phases and overlapped work apart.
    assert list(result.phases()) == list(PULL_PHASES)
    assert set(result.overlapped()) == set(OVERLAPPED_PHASES)
    assert set(progress.phases) == set(PULL_PHASES) | set(OVERLAPPED_PHASES)


def test_corrupted_last_chunk_refused(model_dir: Path, source: ThreadSource) -> None:
    """A flipped byte at the very end of the shard (the last READ, landing in the last memory
    the prefault reaches) fails that peer: nothing partial is served."""
    rank = source.publisher.ranks[0]
    last = max(rank.manifest.tensors, key=lambda e: e.offset + e.nbytes)
    rank.placed[last.name].reshape(-1).view(torch.uint8)[-1] ^= 0xFF
    plan = make_plan(model_dir, pod="tgt-p", role="Target", peers=[source.candidate])
    progress = LoadProgress()
    with pytest.raises(LoadError, match=rf"tensor '{last.name}': xxh3 checksum"):
        PeerToPeerLoader(options=PIPELINED).load(plan, 0, CPU, progress)
    assert progress.loaded_from is None


def test_without_prefault_every_tensor_still_verified(
    model_dir: Path, source: ThreadSource
) -> None:
    opts = PullOptions(**{**PIPELINED.__dict__, "prefault": False})
    plan = make_plan(model_dir, pod="tgt-p", role="Target", peers=[source.candidate])
    loader = PeerToPeerLoader(options=opts)
    got = loader.load(plan, 1, CPU, LoadProgress())
    for name, t in reference(model_dir, 1).items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert loader.last_result is not None and loader.last_result.overlapped() == {
        "memory_wait": 0.0
    }
