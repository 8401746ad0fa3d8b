"""Preload's two paths: CPU (files mapped into one region, populated up front: resident, private,
writable, unmapped with the last tensor) and staged (read into a ring of buffers, then copied:
the CUDA path, run here on CPU)."""

from __future__ import annotations

import gc
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.worker import pad_header
from weightlift.bench.load import copied_bytes
from weightlift.worker.loaders import preload
from weightlift.worker.loaders.preload import PreloadLoader
from weightlift.worker.weights.files import index_files, rank_files
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import TENSOR_ALIGNMENT, all_bit_equal

CPU = torch.device("cpu")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc interfaces")


def _files(tmp_path: Path, n: int = 3, residue: int = 0) -> list[Path]:
    """n files; every tensor's bytes start at `residue` mod 64 in its file (0: all aligned,
    so the mapped path serves them in place)."""
    g = torch.Generator().manual_seed(7)
    for i in range(n):
        path = tmp_path / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(
            {
                f"f{i}.a": torch.randn(300, 256, generator=g),
                f"f{i}.b": torch.randint(0, 100, (1024,), dtype=torch.int16, generator=g),
                f"f{i}.c": torch.randn(32, generator=g).to(torch.bfloat16),
            },
            str(path),
        )
        pad_header(path, residue)
    return rank_files(tmp_path, 0, 1)


def _reference(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v.clone() for k, v in load_file(str(f)).items()})
    return out


def _present(t: torch.Tensor) -> list[bool]:
    """Per 4 KiB page of t's bytes: is it mapped in this process's page tables right now?"""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        raw = f.read((end - start) * 8)
    return [bool(e >> 63) for (e,) in struct.iter_unpack("<Q", raw)]


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_mapped_bit_equal_one_storage_progress(tmp_path: Path, threads: int) -> None:
    files = _files(tmp_path)
    idx = index_files(files)
    progress = LoadProgress()
    got = PreloadLoader().load_index(idx, CPU, progress, threads=threads, chunk_bytes=4096)
    assert all_bit_equal(got, _reference(files))
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    assert progress.bytes_loaded == progress.bytes_total == idx.data_bytes
    assert progress.finished is not None


@linux
def test_mapped_pages_are_resident_on_return(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    for f in files:  # cold: nothing of these files in the page cache
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    got = PreloadLoader().load_index(index_files(files), CPU, LoadProgress(), threads=2)
    for name, t in got.items():
        assert all(_present(t)), name  # no page fault left for serving


@linux
def test_mapped_tensors_private_writable_and_unmapped_after_use(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    before = [f.read_bytes() for f in files]
    got = PreloadLoader().load_index(index_files(files), CPU, LoadProgress())
    assert _mapped(files[0])
    got["f0.a"].fill_(1.0)  # copy-on-write: our page only
    assert bool((got["f0.a"] == 1.0).all())
    assert [f.read_bytes() for f in files] == before
    again = PreloadLoader().load_index(index_files(files), CPU, LoadProgress())
    assert all_bit_equal(again, _reference(files))
    view = got["f1.b"][10:20]  # a view keeps the whole region alive
    del got, again
    gc.collect()
    assert _mapped(files[0])
    assert view.sum().item() == _reference(files)["f1.b"][10:20].sum().item()
    del view
    gc.collect()
    assert not any(_mapped(f) for f in files)


@linux
@pytest.mark.parametrize("residue", [0, 8, 40])
@pytest.mark.parametrize("staged", [False, True])
def test_tensors_sit_at_their_file_offsets_mod_64(
    tmp_path: Path, staged: bool, residue: int
) -> None:
    """Files whose data sits off a 64-byte boundary (most real ones: headers are padded to 8
    bytes) are served at their canonical placement (weights/tensors.py): each tensor at its
    file offset mod 64, the same as a P2P target's buffer gives it
    (tests/unit/worker/test_identical_outputs.py). The mapped path copies no byte for it."""
    files = _files(tmp_path, 2, residue=residue)
    idx = index_files(files)
    got = PreloadLoader(staged=staged).load_index(idx, CPU, LoadProgress())
    assert all_bit_equal(got, _reference(files))
    for name, (_, info) in idx.tensors.items():
        assert got[name].data_ptr() % TENSOR_ALIGNMENT == info.begin % TENSOR_ALIGNMENT, name
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    if not staged:
        assert copied_bytes(got, files) == 0
        assert all(_mapped(f) for f in files)


def test_mapped_misaligned_data_is_copied_aligned(tmp_path: Path) -> None:
    # A header padded to an odd length puts float32 data at an odd address: torch cannot view it.
    a = torch.arange(1000, dtype=torch.float32)
    header = json.dumps({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}})
    raw = header.encode() + b" " * (1 - len(header) % 2 + 2)  # 8 + odd length
    assert (8 + len(raw)) % 4
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + a.numpy().tobytes())
    got = PreloadLoader().load_index(index_files([p]), CPU, LoadProgress())
    assert torch.equal(got["a"], a)
    assert got["a"].data_ptr() % TENSOR_ALIGNMENT == 0  # a copy's canonical residue


def test_populate_fallback_touches_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 5.14 answer EINVAL to MADV_POPULATE_READ: read one byte per page."""
    monkeypatch.setattr(preload, "_populate_unsupported", True)
    files = _files(tmp_path, 2)
    progress = LoadProgress()
    got = PreloadLoader().load_index(index_files(files), CPU, progress, threads=2)
    assert all_bit_equal(got, _reference(files))
    assert progress.bytes_loaded == progress.bytes_total


@linux
def test_file_shrinks_after_mapping_is_an_error_not_sigbus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path, 1)
    idx = index_files(files)
    real = preload._Region.map_file

    def map_then_shrink(self: preload._Region, *args: object) -> None:
        real(self, *args)  # type: ignore[arg-type]
        os.truncate(files[0], 8192)

    monkeypatch.setattr(preload._Region, "map_file", map_then_shrink)
    with pytest.raises(LoadError, match=r"model-00001-of-00001\.safetensors: truncated"):
        PreloadLoader().load_index(idx, CPU, LoadProgress())
    gc.collect()
    assert not _mapped(files[0])


def test_missing_file_names_it(tmp_path: Path) -> None:
    files = _files(tmp_path, 2)
    idx = index_files(files)
    files[1].unlink()
    for staged in (False, True):
        with pytest.raises(LoadError, match=r"model-00002-of-00002\.safetensors: cannot open"):
            PreloadLoader(staged=staged).load_index(idx, CPU, LoadProgress())


@pytest.mark.parametrize("chunk_bytes", [4096, 12345, 64 << 20])
def test_staged_path_bit_equal(tmp_path: Path, chunk_bytes: int) -> None:
    """The CUDA path's ring of staging buffers, exercised on CPU (more chunks than slots)."""
    files = _files(tmp_path)
    idx = index_files(files)
    progress = LoadProgress()
    got = PreloadLoader(staged=True).load_index(
        idx, CPU, progress, threads=2, chunk_bytes=chunk_bytes
    )
    assert all_bit_equal(got, _reference(files))
    assert progress.bytes_loaded == progress.bytes_total == idx.data_bytes
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1


def test_empty_and_zero_size(tmp_path: Path) -> None:
    save_file({"e": torch.empty(0, 3), "s": torch.tensor(2.0)}, str(tmp_path / "model.safetensors"))
    save_file({"z": torch.empty(0)}, str(tmp_path / "other.safetensors"))
    for staged in (False, True):
        idx = index_files([tmp_path / "model.safetensors", tmp_path / "other.safetensors"])
        got = PreloadLoader(staged=staged).load_index(idx, CPU, LoadProgress())
        ref = load_file(str(tmp_path / "model.safetensors")) | load_file(
            str(tmp_path / "other.safetensors")
        )
        assert all_bit_equal(got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned + H2D)")
def test_staged_cuda_many_chunks(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    files = _files(tmp_path)
    dev = torch.device("cuda", 0)
    got = PreloadLoader().load_index(
        index_files(files), dev, LoadProgress(), threads=2, chunk_bytes=8192
    )
    assert all(t.device == dev for t in got.values())
    assert all_bit_equal(got, _reference(files))
