"""Pure parts of p2p: manifest validation, shape/dtype/identity checks, checksums, selection."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from weightlift.api.worker import PeerCandidate
from weightlift.worker.p2p.expected import (
    ExpectedTensor,
    ShapeMismatch,
    check_manifest,
    expected_for_rank,
)
from weightlift.worker.p2p.manifest import (
    CHECKSUM_KINDS,
    RankManifest,
    Region,
    TensorEntry,
    checksum,
)
from weightlift.worker.p2p.rendezvous import rendezvous_order


def _manifest(**over: object) -> RankManifest:
    fields: dict[str, object] = dict(
        identity="id-a",
        rank=1,
        pod="src-0",
        agent="agent",
        agent_metadata="",
        mem_type="DRAM",
        total_bytes=24,
        regions=[Region(addr=4096, nbytes=256)],
        tensors=[
            TensorEntry(
                name="w", dtype="F32", shape=[2, 2], nbytes=16, region=0, offset=0, checksum="x"
            ),
            TensorEntry(
                name="b", dtype="F16", shape=[4], nbytes=8, region=0, offset=16, checksum="y"
            ),
        ],
    )
    fields.update(over)
    return RankManifest.model_validate(fields)


EXPECTED = {"w": ExpectedTensor("F32", (2, 2)), "b": ExpectedTensor("F16", (4,))}


def test_manifest_matches() -> None:
    check_manifest(_manifest(), identity="id-a", rank=1, expected=EXPECTED, peer="src-0")
    check_manifest(_manifest(), identity="id-a", rank=1, expected=None, peer="src-0")


def test_a_peer_with_another_layout_is_refused_by_name() -> None:
    """An engine's parameters keep their names and shapes across versions while their meaning
    may change: a target takes only the layout it was made by, and a checkpoint's only from a
    checkpoint's."""
    vllm32 = _manifest(layout="vLLM 0.32.0")
    ours = "vLLM 0.32.0"
    check_manifest(vllm32, identity="id-a", rank=1, expected=EXPECTED, peer="src-0", layout=ours)
    cases = [
        (_manifest(layout="vLLM 0.31.0"), ours, "laid out by vLLM 0.31.0, ours by vLLM 0.32.0"),
        (_manifest(), ours, "laid out by the checkpoint's, ours by vLLM 0.32.0"),
        (vllm32, "", "laid out by vLLM 0.32.0, ours by the checkpoint's"),
    ]
    for manifest, layout, message in cases:
        with pytest.raises(ShapeMismatch, match="peer src-0") as err:
            check_manifest(
                manifest, identity="id-a", rank=1, expected=EXPECTED, peer="src-0", layout=layout
            )
        assert message in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "expected", "message"),
    [
        ({"identity": "id-b"}, EXPECTED, "model identity 'id-a' != ours 'id-b'"),
        ({"rank": 0}, EXPECTED, "manifest is for rank 1, we need 0"),
        ({}, {**EXPECTED, "w": ExpectedTensor("F32", (4, 1))}, "tensor 'w' shape [2, 2]"),
        ({}, {**EXPECTED, "b": ExpectedTensor("BF16", (4,))}, "tensor 'b' dtype F16"),
        ({}, {**EXPECTED, "c": ExpectedTensor("F16", (1,))}, "lacks 1 tensor(s), e.g. 'c'"),
        ({}, {"w": EXPECTED["w"]}, "1 unexpected tensor(s), e.g. 'b'"),
    ],
)
def test_mismatch_rejected(
    kwargs: dict[str, object], expected: dict[str, ExpectedTensor], message: str
) -> None:
    identity = str(kwargs.get("identity", "id-a"))
    rank = int(kwargs.get("rank", 1))  # type: ignore[call-overload]
    with pytest.raises(ShapeMismatch, match="peer src-0") as err:
        check_manifest(_manifest(), identity=identity, rank=rank, expected=expected, peer="src-0")
    assert message in str(err.value)


def test_manifest_rejects_inconsistent_entries() -> None:
    with pytest.raises(ValidationError, match="is 16 bytes, manifest says 12"):
        TensorEntry(
            name="w", dtype="F32", shape=[2, 2], nbytes=12, region=0, offset=0, checksum="x"
        )
    with pytest.raises(ValidationError, match="unknown dtype"):
        TensorEntry(name="w", dtype="F31", shape=[1], nbytes=4, region=0, offset=0, checksum="x")
    with pytest.raises(ValidationError, match="run past its region"):
        _manifest(regions=[Region(addr=0, nbytes=20)])
    with pytest.raises(ValidationError, match="region 3 does not exist"):
        _manifest(
            tensors=[
                TensorEntry(
                    name="w", dtype="U8", shape=[24], nbytes=24, region=3, offset=0, checksum="x"
                )
            ]
        )
    with pytest.raises(ValidationError, match="total_bytes"):
        _manifest(total_bytes=25)


def test_checksums_see_every_byte() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    for kind in CHECKSUM_KINDS:
        a = checksum(t, kind)
        u = t.clone()
        u.view(torch.uint8)[2345] ^= 1
        assert checksum(u, kind) != a
        assert checksum(t.clone(), kind) == a
        empty = checksum(torch.empty(0, 3, dtype=torch.bfloat16), kind)
        assert empty == checksum(torch.empty(0), kind)
    assert checksum(torch.tensor(1.0, dtype=torch.bfloat16))  # 0-dim works


def test_expected_from_headers(model_dir: Path) -> None:
    exp = expected_for_rank(model_dir, 1, 2)
    assert exp is not None
    assert exp["layers.0.attn.bias"].dtype == "F16"
    assert exp["embed.scale"] == ExpectedTensor("I64", (1,))
    cast = expected_for_rank(model_dir, 1, 2, cast_dtype="bfloat16")
    assert cast is not None
    assert cast["layers.0.attn.bias"].dtype == "BF16"
    assert cast["embed.scale"].dtype == "I64"  # integers are never cast
    assert expected_for_rank(model_dir / "nope", 0, 2) is None


def test_rendezvous_spreads_and_is_stable() -> None:
    sources = [PeerCandidate(pod=f"src-{i}", address=f"10.0.0.{i}:8000") for i in range(4)]
    firsts = Counter(rendezvous_order(f"tgt-{i}", sources)[0].pod for i in range(400))
    assert set(firsts) == {s.pod for s in sources}
    assert min(firsts.values()) > 50  # roughly even: 100 each
    # Removing one source only moves the targets that had it first.
    for i in range(100):
        full = rendezvous_order(f"tgt-{i}", sources)
        less = rendezvous_order(f"tgt-{i}", sources[1:])
        if full[0].pod != "src-0":
            assert less[0] == full[0]
    dup = rendezvous_order("t", [sources[0], sources[0], sources[1]])
    assert len(dup) == 2


def _layout(manifest: RankManifest, device: torch.device) -> tuple[list[int], int]:
    """The offsets and buffer size a target's `_Pull.alloc` picks for `manifest`."""
    from weightlift.worker.p2p.target import PullOptions, _Pull

    pull = _Pull("src-0", "127.0.0.1:1", "id-a", 1, device, PullOptions(prefault=False), None)
    try:
        pull.alloc(manifest)
        assert pull.buf is not None
        assert pull.buf.data_ptr() % 64 == 0
        return pull.offsets, pull.buf.numel()
    finally:
        pull.close()


@pytest.mark.parametrize("order", [["a", "b", "c", "d"], ["d", "c", "b", "a"]])
@pytest.mark.parametrize("base", [4096, 4096 + 8, 4096 + 40])
def test_target_layout_keeps_source_residues_and_early_size(order: list[str], base: int) -> None:
    """A host target places each tensor at its source's address mod 64 (the canonical
    placement, weights/tensors.py), without overlaps, in a buffer exactly as large as the one
    it sized from its local headers before the manifest arrived (any order, any residues)."""
    from weightlift.worker.p2p.target import _layout_size

    expected = {
        "a": ExpectedTensor(dtype="F16", shape=(3, 5)),
        "b": ExpectedTensor(dtype="F32", shape=(7,)),
        "c": ExpectedTensor(dtype="U8", shape=(0,)),
        "d": ExpectedTensor(dtype="BF16", shape=(1000, 3)),
    }
    sizes = {"a": 30, "b": 28, "c": 0, "d": 6000}
    offsets, at = [], 0
    for name in order:  # the source's own layout: packed back to back from `base`
        offsets.append(at)
        at += sizes[name] + (-sizes[name] % 4)
    entries = [
        TensorEntry(
            name=n,
            dtype=expected[n].dtype,
            shape=list(expected[n].shape),
            nbytes=sizes[n],
            region=0,
            offset=off,
            checksum="x",
        )
        for n, off in zip(order, offsets, strict=True)
    ]
    manifest = _manifest(
        regions=[Region(addr=base, nbytes=at)], tensors=entries, total_bytes=sum(sizes.values())
    )
    got, size = _layout(manifest, torch.device("cpu"))
    assert size == _layout_size(expected)
    spans = []
    for t, off in zip(entries, got, strict=True):
        if t.nbytes:
            assert off % 64 == (base + t.offset) % 64, t.name
            spans.append((off, off + t.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert spans[-1][1] <= size
    assert _layout_size({"x": ExpectedTensor(dtype="NOPE", shape=(1,))}) is None
