"""Preload's staged path (the CUDA path, run on CPU): the staging pool, the copy engine's waits,
O_DIRECT reads, the layout that keeps every tensor once. ~3 s."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.worker import pad_header
from weightlift.worker.loaders import registered, staged
from weightlift.worker.loaders.copyengine import ThreadCopyEngine
from weightlift.worker.loaders.layout import IO_ALIGN, Chunk
from weightlift.worker.loaders.pagecache import direct_io_supported, resident_fraction
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.loaders.staging import Geometry, StagingPool
from weightlift.worker.weights.files import index_files
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import TENSOR_ALIGNMENT, all_bit_equal

CPU = torch.device("cpu")


def _files(tmp_path: Path, n: int = 2, residue: int = 0, odd: bool = False) -> list[Path]:
    """n files of a few 4 KiB chunks each; `odd` adds tensors whose sizes put the next ones off
    64-byte (and element) boundaries, and makes each file's length not a multiple of 4 KiB."""
    g = torch.Generator().manual_seed(3)
    paths = []
    for i in range(n):
        path = tmp_path / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {
            f"f{i}.a": torch.randn(37, 101, generator=g),
            f"f{i}.b": torch.randint(0, 100, (1001,), dtype=torch.int16, generator=g),
        }
        if odd:
            tensors[f"f{i}.u8"] = torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g)
            tensors[f"f{i}.h"] = torch.randn(77, generator=g).to(torch.bfloat16)
        save_file(tensors, str(path))
        pad_header(path, residue)
        paths.append(path)
    return paths


def _reference(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v.clone() for k, v in load_file(str(f)).items()})
    return out


def _pool(slots: int = 8, slot_bytes: int = 4096) -> StagingPool:
    return StagingPool(Geometry(slots, slot_bytes), pinned=False)


class HeldCopies(ThreadCopyEngine):
    """The slowest legal stream: a copy runs (on the engine's thread) only once someone waits
    for a ticket, or the engine closes."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.some_queued = threading.Event()
        self.queued = 0
        self.done = 0
        super().__init__()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queued += 1
        super().copy(dst, src)
        self.some_queued.set()

    def run_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.gate.wait()
        dst.copy_(src)
        self.done += 1

    def wait(self, ticket: threading.Event) -> None:
        self.gate.set()
        super().wait(ticket)

    def close(self) -> None:
        self.gate.set()
        super().close()


class WatchedPool(StagingPool):
    """Records, each time slots come back, how many queued copies were not done yet."""

    def __init__(self, engine: HeldCopies) -> None:
        super().__init__(Geometry(16, 4096), pinned=False)
        self.engine = engine
        self.in_flight_at_release: list[int] = []

    def release(self, slots: list[int]) -> None:
        self.in_flight_at_release.append(self.engine.queued - self.engine.done)
        super().release(slots)


def test_failed_read_waits_for_every_queued_copy_before_slots_go_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path)
    idx = index_files(files)
    engine = HeldCopies()
    pool = WatchedPool(engine)
    real = staged.read_chunk

    def fail_last_chunk_of_file_2(path: str, view: memoryview, c: Chunk, *, direct: bool) -> bool:
        if c.file_no == 1 and c.data_hi == idx.files[1].file_size:
            engine.some_queued.wait()  # other chunks' copies are queued (held) by now
            raise LoadError(f"{path}: read failed at offset {c.start}: injected")
        return real(path, view, c, direct=direct)

    monkeypatch.setattr(staged, "read_chunk", fail_last_chunk_of_file_2)
    loader = PreloadLoader(staged=True, pool=pool, copy_engine=lambda _: engine)
    # Every chunk has a slot of its own (no slot is reused, so nothing waits on the way): the
    # held copies run only if the failure path waits for them.
    assert sum(f.stat().st_size // 4096 + 1 for f in files) <= 10
    with pytest.raises(LoadError, match=r"model-00002-of-00002\.safetensors: read failed"):
        loader.load_index(idx, CPU, LoadProgress(), threads=8, chunk_bytes=4096)
    assert len(pool.in_flight_at_release) == 1
    assert engine.queued > 0
    assert pool.in_flight_at_release == [0]  # nothing read the slots once they were back
    assert sorted(pool._free) == list(range(16))


def test_async_copies_slot_reused_only_after_its_copy(tmp_path: Path) -> None:
    """More chunks than slots, copies held until waited for: a slot overwritten before its
    copy ran would show as wrong bytes."""
    files = _files(tmp_path, 3, residue=8, odd=True)
    engine = HeldCopies()
    loader = PreloadLoader(staged=True, pool=_pool(4), copy_engine=lambda _: engine)
    progress = LoadProgress()
    got = loader.load_index(index_files(files), CPU, progress, threads=2, chunk_bytes=4096)
    assert all_bit_equal(got, _reference(files))
    assert progress.bytes_loaded == progress.bytes_total
    assert engine.done == engine.queued > 4


@pytest.mark.parametrize("residue", [0, 8, 40])
def test_unaligned_tensors_are_views_of_one_buffer(tmp_path: Path, residue: int) -> None:
    """Tensors off their element's boundary used to be copied once more beside the buffer;
    the layout puts each at its canonical residue, so all stay views of one buffer."""
    files = _files(tmp_path, 2, residue=residue, odd=True)
    idx = index_files(files)
    got = PreloadLoader(staged=True, pool=_pool()).load_index(idx, CPU, threads=2)
    assert all_bit_equal(got, _reference(files))
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    for name, (_, info) in idx.tensors.items():
        elem = got[name].element_size()
        want = info.begin % TENSOR_ALIGNMENT if info.begin % elem == 0 else 0
        assert got[name].data_ptr() % TENSOR_ALIGNMENT == want, name


def _drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("chunk_bytes", [4096, 3 * 4096, 1 << 20])
def test_o_direct_reads_bit_equal_with_unaligned_tails(tmp_path: Path, chunk_bytes: int) -> None:
    files = _files(tmp_path, 2, residue=40, odd=True)
    if not direct_io_supported(str(files[0])):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    assert all(f.stat().st_size % IO_ALIGN for f in files)  # tails end mid-block
    loader = PreloadLoader(staged=True, pool=_pool(4, 1 << 20), direct_io="always")
    got = loader.load_index(index_files(files), CPU, threads=2, chunk_bytes=chunk_bytes)
    assert all_bit_equal(got, _reference(files))
    assert loader.stats.direct > 0 and loader.stats.buffered == 0


def test_cold_chunks_read_with_o_direct_warm_ones_buffered(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    if not direct_io_supported(str(files[0])):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    idx = index_files(files)  # reading the headers reads ahead: drop the cache after it
    _drop_cache(files)
    fd = os.open(files[0], os.O_RDONLY)
    try:
        cold = resident_fraction(fd, 0, files[0].stat().st_size)
    finally:
        os.close(fd)
    if cold > staged.COLD:
        pytest.skip(f"the page cache kept {cold:.0%} of a file after POSIX_FADV_DONTNEED")
    loader = PreloadLoader(staged=True, pool=_pool())
    got = loader.load_index(idx, CPU, threads=2, chunk_bytes=4096)
    assert loader.stats.direct > 0 and loader.stats.buffered == 0
    assert all_bit_equal(got, _reference(files))
    for f in files:  # now warm: buffered reads
        f.read_bytes()
    loader.load_index(idx, CPU, threads=2, chunk_bytes=4096)
    assert loader.stats.buffered > 0 and loader.stats.direct == 0


def test_registration_never_attempted_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> bool:
        raise AssertionError("cudaHostRegister on a CPU target")

    monkeypatch.setattr(registered, "register", refuse)
    monkeypatch.setattr(registered, "FileMapping", refuse)
    assert not registered.registration_allowed(CPU)
    files = _files(tmp_path)
    loader = PreloadLoader(staged=True, pool=_pool(), register=True)
    got = loader.load_index(index_files(files), CPU, threads=2, chunk_bytes=4096)
    assert all_bit_equal(got, _reference(files))
    assert loader.stats.registered == 0


def test_slot_memory_is_aligned_for_o_direct() -> None:
    pool = _pool(3, 2 * IO_ALIGN)
    assert [s.data_ptr() % IO_ALIGN for s in pool.slots] == [0, 0, 0]
    with pool.lease(10) as got:
        assert len(got) == 3
    assert sorted(pool._free) == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("register", [True, False])
def test_cuda_registered_and_staged_bit_equal(
    tmp_path: Path, register: bool
) -> None:  # pragma: no cover - GPU only
    files = _files(tmp_path, 3, residue=8, odd=True)
    loader = PreloadLoader(register=register)
    got = loader.load_index(index_files(files), torch.device("cuda"), threads=2, chunk_bytes=8192)
    assert all(t.device.type == "cuda" for t in got.values())
    assert all(t.data_ptr() % TENSOR_ALIGNMENT == 0 for t in got.values())
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    assert all_bit_equal(got, _reference(files))


def test_pinned_pool_pins_each_slot_once_and_keeps_refused_ones_pageable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver's answers stand in (no GPU here): slot 1 is refused, the rest pinned."""
    calls: list[int] = []
    pool = StagingPool(Geometry(3, IO_ALIGN), pinned=True)
    refused = pool.slots[1].data_ptr()

    def host_register(addr: int, length: int, flags: int) -> str | None:
        assert length == IO_ALIGN and flags == registered.CUDA_HOST_REGISTER_PORTABLE
        calls.append(addr)
        return "operation not supported" if addr == refused else None

    monkeypatch.setattr(registered, "host_register", host_register)
    assert calls == []  # made by a load: pinned slot by slot, when used
    assert pool.pin(0) and not pool.pin(1)
    assert pool.pin_all() == 2
    assert sorted(calls) == sorted(s.data_ptr() for s in pool.slots)  # each tried once
    assert not StagingPool(Geometry(2, IO_ALIGN), pinned=False).pin(0)
