"""dev64's word sums as a Triton kernel, for CUDA tensors (`devsum.py` says what is summed).

Imported only by `devsum` and only for CUDA bytes: Triton ships with torch's CUDA wheels, and a
CPU-only worker never needs it. With TRITON_INTERPRET=1 set before the import the same kernel
runs on CPU tensors through Triton's interpreter, which is how a host without a GPU tests its
arithmetic against the CPU reference.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

_LAUNCH = threading.Lock()
# Words per program: BLOCK lanes, ITERS steps; one uint64 partial per program.
BLOCK = 1024
ITERS = 16
NUM_WARPS = 4


@triton.jit
def _mix(z):
    # Stafford's Mix13 (splitmix64's finalizer); devsum.mix64 is the reference.
    z ^= z >> 30
    z *= 0xBF58476D1CE4E5B9
    z ^= z >> 27
    z *= 0x94D049BB133111EB
    z ^= z >> 31
    return z


# The scalars are not specialised: every tensor size, start index and segment key reuses the
# compiled kernels, one per EVEN and pointer alignment (16 bytes or not): four in a process
# (devsum.prewarm compiles them ahead of a pull).
@triton.jit(do_not_specialize=["first_program", "n_words", "first_index", "segment_key"])
def _word_sums(
    words_ptr,
    out_ptr,
    first_program,
    n_words,
    first_index,
    segment_key,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EVEN: tl.constexpr,
):
    pid = tl.program_id(0) + first_program
    start = pid.to(tl.int64) * (BLOCK * ITERS)
    first = first_index.to(tl.int64)
    key = segment_key.to(tl.int64).to(tl.uint64, bitcast=True)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for k in range(ITERS):
        offs = start + k * BLOCK + tl.arange(0, BLOCK)
        if EVEN:  # every word in range: unmasked loads, which vectorise
            w = tl.load(words_ptr + offs)
        else:
            mask = offs < n_words
            w = tl.load(words_ptr + offs, mask=mask, other=0)
        word = w.to(tl.uint32, bitcast=True).to(tl.uint64)
        index = (offs + first).to(tl.uint64)
        term = _mix(((index << 32) | word) ^ key)
        if EVEN:
            acc += term
        else:
            acc += tl.where(mask, term, tl.zeros_like(term))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def word_sums(words: torch.Tensor, first_index: int, segment_key: int) -> int:
    """Sum mod 2^64 of dev64's word terms over `words` (int32, 4-byte aligned, contiguous),
    the first at word index `first_index` of its 2^32-word segment (key `segment_key`)."""
    n = words.numel()
    if n == 0:
        return 0
    per_program = BLOCK * ITERS
    full = n // per_program
    programs = triton.cdiv(n, per_program)
    partials = torch.empty(programs, dtype=torch.int64, device=words.device)
    signed_key = segment_key - (1 << 64) if segment_key >= 1 << 63 else segment_key
    # Whole programs' worth of words unmasked, then the rest masked in one more program (the
    # same pointers, so the same specialisation). Launches are serialised: Triton's runtime
    # (its compile and kernel caches) is not safe to enter from several threads at once, and
    # the verify and publish pools hash tensors in parallel; a launch is microseconds.
    with _LAUNCH:
        for first_program, count, even in ((0, full, True), (full, programs - full, False)):
            if count:
                _word_sums[(count,)](
                    words, partials, first_program, n, first_index, signed_key,
                    BLOCK=BLOCK, ITERS=ITERS, EVEN=even, num_warps=NUM_WARPS,
                )  # fmt: skip
    # int64 sums wrap two's complement: the same bits as uint64 mod 2^64.
    return int(partials.sum().item()) & ((1 << 64) - 1)
