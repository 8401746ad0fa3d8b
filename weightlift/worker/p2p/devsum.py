"""dev64: a 64-bit checksum of a tensor's bytes, computed on the device that holds them.

Definition. A tensor's n bytes are read as little-endian 32-bit words w_0 .. w_{m-1},
m = ceil(n / 4), the last word zero-padded. Word i is hashed with its index:

    u_i   = ((i mod 2^32) << 32 | w_i)  XOR  mix(i >> 32)
    S     = sum over i of mix(u_i)  (mod 2^64)
    dev64 = mix(S XOR mix(n + GOLDEN))

where mix is Stafford's Mix13, splitmix64's finalizer (two odd multiplies and three xor-shifts,
a bijection of 64-bit words with full avalanche), and GOLDEN is splitmix64's increment.
`mix64`, `word_term` and `finish` below are the scalar definition; the numpy code here is the
reference every other implementation must equal bit for bit (`devsum_triton` on CUDA; torch ops
on CUDA when Triton is missing).

Why this shape:
- Any change confined to one word is always detected: a flipped bit, a changed byte, two bytes
  swapped inside a word. (i, w_i) -> u_i is injective within 2^32 words, mix is a bijection, so
  the one term changes and S changes; the final step is a bijection of S for a given n.
- Changes that span words (two words swapped, bytes shifted by 1 or 4, a block moved) change
  the multiset of (index, word) pairs, and the digest stays only if the mixed terms removed sum
  to the terms added: about 2^-64 for bytes not built against mix. A plain sum or xor of the
  words, position-free, misses every swap and shift; a CRC catches them but is serial.
- The length is mixed into the final step, so zero bytes cut or appended, which may leave
  every word as it was (the last word is zero-padded), always change the digest.
- Over 2^32 words (16 GiB) the index's high part enters through mix(i >> 32): within each
  16 GiB segment inputs stay distinct; across two segments a collision needs a word pair at
  one distance with one xor difference, each fixed by the pair of segments.
- Not a MAC: peers are authenticated elsewhere (peer_auth); this guards against corruption.
- S is a sum of terms of (index, word) only, so the digest is the same whatever the memory
  alignment of the bytes, and slices hashed anywhere, in any order, at their byte offsets, add
  up to it (`Dev64`). That lets a GPU reduce it at memory speed and CPU threads split it.
- 32-bit words keep index and word inside one 64-bit mix input (injective, so the certain
  detection above holds); 64-bit words would halve the work but lose it.

On a GPU the cost is integer ALU work (two 64-bit multiplies and three 64-bit xor-shifts per 4
bytes), several TB/s on an H100/H200. On a CPU it is numpy passes over uint64 scratch, chunked to
stay in cache, a thread per slice of a large tensor (numpy releases the GIL); about 1 GB/s a
core, far below xxh3, which is why CPU pairs keep xxh3 (manifest.resolve_kind).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
GOLDEN = 0x9E3779B97F4A7C15
SEGMENT_WORDS = 1 << 32

# CPU: words per numpy pass (2 uint64 scratch arrays of 512 KiB stay in L2) and words per
# thread-pool task (16 MiB of bytes, so pool overhead stays far below the work).
_CPU_CHUNK_WORDS = 1 << 16
_CPU_TASK_WORDS = 1 << 22
# CUDA: unaligned bytes are copied to aligned memory this many bytes at a time; the torch-ops
# fallback works this many words at a time (two int64 temporaries of 256 MiB).
_GPU_COPY_BYTES = 256 << 20
_TORCH_CHUNK_WORDS = 1 << 25


def mix64(z: int) -> int:
    """Stafford's Mix13 on a 64-bit integer (the scalar definition)."""
    z &= MASK64
    z ^= z >> 30
    z = (z * _M1) & MASK64
    z ^= z >> 27
    z = (z * _M2) & MASK64
    return z ^ (z >> 31)


def word_term(index: int, word: int) -> int:
    """mix(u_i) for word `word` (0..2^32-1) at word index `index` of the tensor."""
    return mix64(((index % SEGMENT_WORDS) << 32 | word) ^ mix64(index // SEGMENT_WORDS))


def finish(total: int, nbytes: int) -> int:
    """The digest of n bytes whose word terms sum to `total`."""
    return mix64((total & MASK64) ^ mix64(nbytes + GOLDEN))


def hexdigest(value: int) -> str:
    return f"{value:016x}"


def dev64_cpu(tensor: torch.Tensor) -> int:
    """The reference: dev64 of a tensor's bytes computed on the CPU (CUDA bytes are copied to
    host memory in slices first). `bench gpu` checks the kernel against this."""
    flat = _flat_bytes(tensor)
    if flat.device.type == "cpu":
        return _digest(flat)
    acc = Dev64(flat.numel())
    for start in range(0, flat.numel(), _GPU_COPY_BYTES):
        acc.update(start, flat[start : start + _GPU_COPY_BYTES].cpu())
    return acc.digest()


def dev64(tensor: torch.Tensor) -> int:
    """dev64 of a contiguous tensor's bytes, computed where they are (CPU or CUDA)."""
    return _digest(_flat_bytes(tensor))


def prewarm(device: torch.device) -> threading.Thread:
    """Compile the CUDA kernels for `device` in a background thread. The first dev64 on CUDA in
    a process compiles them (Triton: about a second each; one per pointer alignment and for a
    tail), which a target should pay while its init hooks run, not inside its timed pull."""

    def run() -> None:
        try:
            data = torch.zeros(4 * (1 << 15) + 20, dtype=torch.uint8, device=device)
            for offset in (0, 4):  # aligned to 16 bytes, and to 4 only
                dev64(data[offset:])
        except Exception as exc:  # the pull computes it anyway and says what fails
            log.warning("dev64: prewarming on %s failed: %r", device, exc)

    thread = threading.Thread(target=run, name="dev64-prewarm", daemon=True)
    thread.start()
    return thread


class Dev64:
    """dev64 of n bytes fed as slices at their byte offsets, on any devices, in any order.

    Each slice's whole words are summed where they are; the up to 3 bytes at either edge wait
    here for the neighbouring slice that completes their word. Thread-safe: slices may be fed
    from several threads. `digest()` refuses bytes missing, overlapping or past the end."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"dev64: negative length {nbytes}")
        self.nbytes = nbytes
        self._total = 0
        self._edges: dict[int, dict[int, int]] = {}  # word index -> {byte position: value}
        self._spans: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def update(self, offset: int, data: torch.Tensor) -> None:
        flat = _flat_bytes(data)
        n = flat.numel()
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(
                f"dev64: slice [{offset}, {offset + n}) outside the {self.nbytes} bytes"
            )
        head = min(n, -offset % 4)
        body = (n - head) // 4 * 4
        edges = [(offset, flat[:head]), (offset + head + body, flat[head + body :])]
        total = _word_sum(flat[head : head + body], (offset + head) // 4) if body else 0
        with self._lock:
            self._spans.append((offset, offset + n))
            self._total += total
            for start, piece in edges:
                for k, byte in enumerate(piece.tolist()):
                    self._edge_byte(start + k, byte)

    def _edge_byte(self, position: int, byte: int) -> None:
        index = position // 4
        word = self._edges.setdefault(index, {})
        word[position] = byte
        if len(word) == min(4, self.nbytes - 4 * index):
            value = sum(b << (8 * (p % 4)) for p, b in word.items())
            self._total += word_term(index, value)
            del self._edges[index]

    def digest(self) -> int:
        with self._lock:
            covered = 0
            for start, stop in sorted(self._spans):
                if start != covered:
                    what = "overlap" if start < covered else "missing"
                    raise ValueError(f"dev64: bytes {what} at offset {min(start, covered)}")
                covered = stop
            if covered != self.nbytes:
                raise ValueError(f"dev64: bytes missing from offset {covered} to {self.nbytes}")
            return finish(self._total, self.nbytes)


# ------------------------------------------------------------------------------ internals
def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("dev64: tensor is not contiguous")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8)


def _digest(flat: torch.Tensor) -> int:
    n = flat.numel()
    body = n // 4 * 4
    total = _word_sum(flat[:body], 0) if body else 0
    if body < n:
        tail = flat[body:].tolist()
        total += word_term(body // 4, sum(b << (8 * k) for k, b in enumerate(tail)))
    return finish(total, n)


def _word_sum(flat: torch.Tensor, first_index: int) -> int:
    """Sum mod 2^64 of the word terms of `flat` (a whole number of words), its first word at
    `first_index`; split where the index crosses into another 2^32-word segment."""
    total = 0
    words = flat.numel() // 4
    done = 0
    while done < words:
        index = first_index + done
        segment, within = divmod(index, SEGMENT_WORDS)
        take = min(words - done, SEGMENT_WORDS - within)
        piece = flat[4 * done : 4 * (done + take)]
        total += _segment_sum(piece, within, mix64(segment))
        done += take
    return total & MASK64


def _segment_sum(flat: torch.Tensor, within: int, key: int) -> int:
    if flat.device.type == "cpu":
        return _cpu_sum(flat.numpy(), within, key)
    # CUDA: the kernel; any other device: torch ops, which run wherever torch does.
    device_sum = _cuda_sum if flat.device.type == "cuda" else torch_word_sum
    return sum(device_sum(piece, within + start // 4, key) for start, piece in _aligned(flat))


# ---------------------------------------------------------------------------------- CPU
class _Scratch(threading.local):
    def __init__(self) -> None:
        self.x = np.empty(_CPU_CHUNK_WORDS, dtype=np.uint64)
        self.t = np.empty(_CPU_CHUNK_WORDS, dtype=np.uint64)


_SCRATCH = _Scratch()
_HIGH = np.arange(_CPU_CHUNK_WORDS, dtype=np.uint64) << np.uint64(32)
_U = {k: np.uint64(k) for k in (27, 30, 31, _M1, _M2)}


@cache
def _cpu_pool() -> ThreadPoolExecutor:
    threads = max(1, min(4, len(os.sched_getaffinity(0))))
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dev64")


def _cpu_sum(data: np.ndarray, within: int, key: int) -> int:
    """numpy, one uint8 array of whole words inside one segment."""
    words = data.size // 4
    tasks = [(s, min(words, s + _CPU_TASK_WORDS)) for s in range(0, words, _CPU_TASK_WORDS)]

    def run(span: tuple[int, int]) -> int:
        return _cpu_task(data[4 * span[0] : 4 * span[1]], within + span[0], key)

    if len(tasks) == 1:
        return run(tasks[0])
    return sum(_cpu_pool().map(run, tasks)) & MASK64


def _cpu_task(data: np.ndarray, within: int, key: int) -> int:
    x_all, t_all = _SCRATCH.x, _SCRATCH.t
    total = 0
    for start in range(0, data.size, 4 * _CPU_CHUNK_WORDS):
        chunk = data[start : start + 4 * _CPU_CHUNK_WORDS]
        if chunk.ctypes.data % 4:
            chunk = chunk.copy()  # numpy's copy is aligned; memory stays one chunk
        w = chunk.view("<u4")
        n = w.size
        x, t = x_all[:n], t_all[:n]
        np.add(_HIGH[:n], np.uint64((within + start // 4) << 32), out=x)
        np.bitwise_or(x, w, out=x)
        if key:
            np.bitwise_xor(x, np.uint64(key), out=x)
        _np_mix(x, t)
        total += int(x.sum(dtype=np.uint64))
    return total & MASK64


def _np_mix(x: np.ndarray, t: np.ndarray) -> None:
    """mix64 in place over a uint64 array (numpy integer arrays wrap silently)."""
    np.right_shift(x, _U[30], out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _U[_M1], out=x)
    np.right_shift(x, _U[27], out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _U[_M2], out=x)
    np.right_shift(x, _U[31], out=t)
    np.bitwise_xor(x, t, out=x)


# ------------------------------------------------------------------------- CUDA and others
def _aligned(flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(byte offset, 4-byte aligned bytes): the tensor itself when aligned, else copies of
    bounded slices (device to device)."""
    if flat.data_ptr() % 4 == 0 and flat.storage_offset() % 4 == 0:
        yield 0, flat
        return
    for start in range(0, flat.numel(), _GPU_COPY_BYTES):
        yield start, flat[start : start + _GPU_COPY_BYTES].clone()


_KERNEL_BROKEN: list[str] = []  # why the Triton path was given up in this process, if it was


def _cuda_sum(flat: torch.Tensor, within: int, key: int) -> int:
    words = flat.view(torch.int32)
    kernel = _triton_word_sums()
    if kernel is not None and not _KERNEL_BROKEN:
        try:
            with torch.cuda.device(flat.device):
                return kernel(words, within, key)
        except Exception as exc:  # no compiler in the image, an unsupported GPU, ...
            _KERNEL_BROKEN.append(repr(exc))
            log.warning("dev64: the Triton kernel failed (%r); using torch ops instead", exc)
    return torch_word_sum(flat, within, key)


def cuda_implementation() -> str:
    """What hashes CUDA bytes in this process, for reports: "triton", or "torch ops" and why."""
    if _triton_word_sums() is None:
        return "torch ops (Triton does not import)"
    if _KERNEL_BROKEN:
        return f"torch ops (the Triton kernel failed: {_KERNEL_BROKEN[0]})"
    return "triton"


@cache
def _triton_word_sums() -> Callable[[torch.Tensor, int, int], int] | None:
    try:
        from weightlift.worker.p2p import devsum_triton
    except ImportError as exc:
        log.warning("dev64: Triton does not import (%s); using torch ops on CUDA", exc)
        return None
    return devsum_triton.word_sums


# torch has no uint64 arithmetic: int64 multiplies and adds wrap two's complement, the same
# bits as uint64 mod 2^64, and an arithmetic right shift masked to the bits a logical one
# keeps is the same as the logical one.
def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_M1S, _M2S = _signed(_M1), _signed(_M2)


def _torch_mix(x: torch.Tensor) -> torch.Tensor:
    x ^= (x >> 30) & ((1 << 34) - 1)
    x *= _M1S
    x ^= (x >> 27) & ((1 << 37) - 1)
    x *= _M2S
    x ^= (x >> 31) & ((1 << 33) - 1)
    return x


def torch_word_sum(flat: torch.Tensor, within: int, key: int) -> int:
    """The word sum with torch ops on any device (bytes 4-byte aligned, inside one segment):
    the CUDA fallback where Triton is missing or fails."""
    words = flat.view(torch.int32)
    total = 0
    for start in range(0, words.numel(), _TORCH_CHUNK_WORDS):
        w = words[start : start + _TORCH_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        index = torch.arange(
            within + start, within + start + w.numel(), dtype=torch.int64, device=w.device
        )
        x = (index << 32) | w
        if key:
            x ^= _signed(key)
        total += int(_torch_mix(x).sum().item())
    return total & MASK64
