"""dev64, the device checksum (worker/p2p/devsum.py): what it detects, that alignment, slicing
and dtype do not change it, that every implementation gives the reference's bits, and a
known answer so the algorithm cannot change silently."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightlift.worker.p2p import devsum
from weightlift.worker.p2p.devsum import Dev64, dev64, dev64_cpu, finish, word_term
from weightlift.worker.p2p.manifest import checksum, resolve_kind


def data(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def scalar(raw: bytes) -> int:
    """The definition, word by word in Python integers."""
    words = [
        int.from_bytes(raw[i : i + 4].ljust(4, b"\0"), "little") for i in range(0, len(raw), 4)
    ]
    return finish(sum(word_term(i, w) for i, w in enumerate(words)), len(raw))


def of(raw: bytes) -> int:
    return dev64(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0))


# ---------------------------------------------------------------------------- definition
def test_known_answers() -> None:
    # Frozen: a change here is a new algorithm, which old manifests would fail against.
    assert f"{of(b''):016x}" == KNOWN["empty"]
    assert f"{of(b'a'):016x}" == KNOWN["a"]
    assert f"{of(bytes(range(256))):016x}" == KNOWN["0..255"]
    counting = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB: several numpy chunks
    assert checksum(counting, "dev64") == KNOWN["arange"]


KNOWN = {
    "empty": "48218226ff3cd4bf",
    "a": "414e8b6620192c9b",
    "0..255": "a6d947152ffc7189",
    "arange": "a5997d933eb6bf52",
}


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 64, 1001, 4 * (1 << 16) + 7])
def test_vectorised_equals_the_scalar_definition(n: int) -> None:
    t = data(n, seed=n)
    assert dev64(t) == scalar(bytes(t.tolist()))


def test_index_past_a_16_gib_segment_is_the_definition() -> None:
    """Words after 2^32 (a tensor over 16 GiB) fold the index's high part in; a slice that
    straddles the boundary is split there."""
    t = data(4 * 40, seed=3)
    first = devsum.SEGMENT_WORDS - 17
    want = sum(
        word_term(first + i, int.from_bytes(bytes(t[4 * i : 4 * i + 4].tolist()), "little"))
        for i in range(40)
    )
    assert devsum._word_sum(t, first) == want & devsum.MASK64
    # ... and the high part matters: the same words one segment later sum differently.
    assert devsum._word_sum(t, first + devsum.SEGMENT_WORDS) != devsum._word_sum(t, first)


# ---------------------------------------------------------------------------- detection
RAW = bytes(data(1027, seed=7).tolist())


def changed(edit: str) -> bytes:
    b = bytearray(RAW)
    if edit == "bit flip":
        b[517] ^= 0x10
    elif edit == "words swapped":
        b[8:12], b[400:404] = b[400:404], b[8:12]
    elif edit == "bytes swapped in a word":
        b[100], b[102] = b[102], b[100]
    elif edit == "shift by 1":
        b = b[1:] + b[:1]
    elif edit == "shift by 4":
        b = b[4:] + b[:4]
    elif edit == "one byte inserted":
        b = b[:50] + b"\x00" + b[50:-1]
    return bytes(b)


@pytest.mark.parametrize(
    "edit",
    [
        "bit flip",
        "words swapped",
        "bytes swapped in a word",
        "shift by 1",
        "shift by 4",
        "one byte inserted",
    ],
)
def test_edits_change_the_digest(edit: str) -> None:
    other = changed(edit)
    assert other != RAW and len(other) == len(RAW)
    assert of(other) != of(RAW)


def test_a_plain_word_sum_would_miss_a_swap() -> None:
    """Why the terms depend on position: a swap keeps the sum and the xor of the words."""

    def words(raw: bytes) -> list[int]:
        return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw) - 3, 4)]

    swapped = changed("words swapped")
    assert sum(words(swapped)) == sum(words(RAW))
    assert of(swapped) != of(RAW)


def test_every_single_bit_flip_is_seen() -> None:
    raw = bytes(data(67, seed=11).tolist())
    digests = {of(raw)}
    for i in range(len(raw) * 8):
        b = bytearray(raw)
        b[i // 8] ^= 1 << (i % 8)
        digests.add(of(bytes(b)))
    assert len(digests) == 1 + len(raw) * 8  # each flip changes it, and no two flips agree


@pytest.mark.parametrize("zeros", [1, 2, 3, 4, 9])
def test_zero_bytes_cut_or_appended_change_the_digest(zeros: int) -> None:
    ends_in_zeros = RAW + bytes(zeros)  # the last word may be the same after zero padding
    assert of(ends_in_zeros) != of(RAW)
    assert of(ends_in_zeros[:-1]) != of(ends_in_zeros)
    assert of(bytes(zeros)) != of(bytes(zeros + 1)) != of(b"")


# ------------------------------------------------------------------------ invariances
def test_same_digest_at_every_memory_alignment() -> None:
    raw = data(4099, seed=5)
    want = dev64(raw)
    buf = torch.zeros(4099 + 8, dtype=torch.uint8)
    for offset in range(8):
        view = buf[offset : offset + 4099]
        view.copy_(raw)
        assert view.data_ptr() % 8 == (buf.data_ptr() + offset) % 8
        assert dev64(view) == want, offset


def test_same_digest_whatever_the_slicing() -> None:
    raw = data(100_003, seed=9)
    want = dev64(raw)
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(
            {0, raw.numel(), *(rng.randrange(raw.numel()) for _ in range(rng.randrange(1, 12)))}
        )
        spans = list(itertools.pairwise(cuts))
        rng.shuffle(spans)
        acc = Dev64(raw.numel())
        with ThreadPoolExecutor(3) as pool:  # fed from threads, in any order
            list(pool.map(lambda s, acc=acc: acc.update(s[0], raw[s[0] : s[1]]), spans))
        assert acc.digest() == want, spans


def test_slices_that_do_not_tile_are_refused() -> None:
    raw = data(40)
    gap = Dev64(40)
    gap.update(0, raw[:10])
    gap.update(12, raw[12:])
    with pytest.raises(ValueError, match="missing at offset 10"):
        gap.digest()
    overlap = Dev64(40)
    overlap.update(0, raw[:10])
    overlap.update(8, raw[8:])
    with pytest.raises(ValueError, match="overlap at offset 8"):
        overlap.digest()
    with pytest.raises(ValueError, match=r"slice \[38, 42\) outside the 40 bytes"):
        Dev64(40).update(38, data(4))


def test_same_bytes_same_digest_whatever_the_dtype() -> None:
    raw = data(1024, seed=2)
    want = dev64(raw)
    for dtype in (torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64):
        assert dev64(raw.view(dtype).reshape(4, -1)) == want, dtype
    assert checksum(raw.view(torch.float16), "dev64") == f"{want:016x}"


def test_non_contiguous_is_refused() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        dev64(torch.zeros(4, 4).t())


# ---------------------------------------------------------------- every implementation
def test_cpu_threads_and_torch_ops_agree_on_a_large_tensor() -> None:
    """20 MiB: two thread-pool tasks of the numpy path, against the torch-ops path (the CUDA
    fallback), here on CPU."""
    raw = data(20 << 20, seed=4)
    assert devsum._word_sum(raw, 0) == devsum.torch_word_sum(raw, 0, 0)


# Run in a fresh interpreter: TRITON_INTERPRET must be set before Triton is first imported (its
# own library kernels, tl.sum's combine among them, are decorated then).
TRITON_CHECK = """
import torch
from weightlift.worker.p2p import devsum, devsum_triton as k
per_program = k.BLOCK * k.ITERS
cases = [(4, 0, 0), (4 * (2 * per_program + 10), 5, 0), (4 * 301, 2**32 - 301, devsum.mix64(1))]
for n, first, key in cases:
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    got, want = k.word_sums(t.view(torch.int32), first, key), devsum._segment_sum(t, first, key)
    assert got == want, (n, first, hex(got), hex(want))
print("kernel == reference")
"""


def test_triton_kernel_arithmetic_equals_the_reference_in_the_interpreter() -> None:
    """The CUDA kernel's own code, run by Triton's interpreter on CPU tensors (a GPU host runs
    it compiled: the CUDA test below and `bench gpu`). ~4 s, mostly importing torch."""
    pytest.importorskip(
        "triton", reason="Triton is not installed (it ships with torch's CUDA wheels)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel == reference" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_kernel_equals_the_cpu_reference() -> None:
    for n in (0, 3, 4096, 4 * 16384 * 3 + 13, 50 << 20):
        raw = data(n + 8, seed=n)
        on_gpu = raw.cuda()
        for offset in (0, 1, 4, 7):  # aligned to 16, unaligned, aligned to 4 only
            assert dev64(on_gpu[offset : offset + n]) == dev64_cpu(raw[offset : offset + n]), (
                n,
                offset,
            )
    assert not devsum._KERNEL_BROKEN, devsum._KERNEL_BROKEN


# ------------------------------------------------------------------------- the setting
def test_auto_is_dev64_on_cuda_and_xxh3_on_cpu() -> None:
    assert resolve_kind("auto", torch.device("cuda", 0)) == "dev64"
    assert resolve_kind("auto", torch.device("cpu")) == "xxh3"
    assert resolve_kind("dev64", torch.device("cpu")) == "dev64"
    assert resolve_kind("crc32", torch.device("cuda", 0)) == "crc32"


def test_triton_kernel_compiles_for_a_gpu_without_one() -> None:
    """Triton compiles for a GPU it does not have (its own ptxas): the kernel's types hold in
    compiled code, not only in the interpreter, and whole programs load 16 bytes at a time.
    ~3 s."""
    pytest.importorskip(
        "triton", reason="Triton is not installed (it ships with torch's CUDA wheels)"
    )
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from weightlift.worker.p2p import devsum_triton as k

    scalars = ("first_program", "n_words", "first_index", "segment_key")
    signature = {"words_ptr": "*i32", "out_ptr": "*i64", **dict.fromkeys(scalars, "i32")}
    for even in (True, False):
        source = ASTSource(
            fn=k._word_sums,
            signature={
                **signature,
                "BLOCK": "constexpr",
                "ITERS": "constexpr",
                "EVEN": "constexpr",
            },
            constexprs={"BLOCK": k.BLOCK, "ITERS": k.ITERS, "EVEN": even},
            attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": k.NUM_WARPS}
        )
        assert compiled.asm["cubin"]
        assert ("ld.global.v4" in compiled.asm["ptx"]) == even


def test_the_cuda_path_is_named() -> None:
    pytest.importorskip(
        "triton", reason="Triton is not installed (it ships with torch's CUDA wheels)"
    )
    assert devsum.cuda_implementation() == "triton"
