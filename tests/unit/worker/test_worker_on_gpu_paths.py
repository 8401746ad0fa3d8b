"""The worker's GPU life, as far as it runs on CPU: init hooks get pod-local device indices,
each rank's thread makes its device current, the staging pool is allocated at worker start
(once) and counted in the host-memory check. ~2 s."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.worker import make_plan
from weightlift.local.models import build_hook_library
from weightlift.worker.engines.base import BringUp
from weightlift.worker.engines.builtin import engine as builtin
from weightlift.worker.loaders import staging
from weightlift.worker.loaders.strategy import choose_storage_loader, host_bytes_needed
from weightlift.worker.main import Worker
from weightlift.worker.server import WorkerState
from weightlift.worker.weights.files import shard_index
from weightlift.worker.weights.progress import LoadProgress

RECORDING = r"""
#include <stdio.h>
void *triton_pytorch_model_init(const char *model_dir, int device_index) {
    FILE *f = fopen("@LOG@", "a");
    if (f) { fprintf(f, "%d\n", device_index); fclose(f); }
    return 0;
}
"""


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    save_file({"w": torch.randn(64, 64)}, str(d / "model.safetensors"))
    return d


@pytest.fixture()
def fresh_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_pools", {})


def test_hooks_of_a_pod_holding_ranks_2_and_3_get_devices_0_and_1(
    model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "devices.log"
    build_hook_library(model_dir / "hooks" / "librec.so", RECORDING.replace("@LOG@", str(log)))
    plan = make_plan(model_dir, tp=4, ranks=[2, 3], initHooks={"library": "hooks/librec.so"})
    engine = builtin.BuiltinEngine(plan)
    state = WorkerState.for_plan(plan)
    asyncio.run(engine.init_hooks(state))
    assert log.read_text().split() == ["0", "1"]
    assert [h.device_index for h in state.report.hooks] == [0, 1]
    assert engine.hooks is not None and engine.hooks.release() == []


def test_each_rank_thread_makes_its_device_current(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device each rank's loader sees as current is the rank's own, set in its thread."""
    current: dict[int, torch.device] = {}  # thread -> device set in it
    seen: dict[int, torch.device] = {}  # rank -> the current device its loader saw

    def set_device(dev: torch.device) -> None:
        current[threading.get_ident()] = dev

    class Recording:
        name = "recording"

        def load(
            self, plan: object, rank: int, device: torch.device, progress: LoadProgress
        ) -> dict[str, torch.Tensor]:
            seen[rank] = current[threading.get_ident()]
            return {}

    monkeypatch.setattr(builtin.torch.cuda, "set_device", set_device)
    monkeypatch.setattr(builtin, "choose_storage_loader", lambda plan, devices: Recording())
    plan = make_plan(model_dir, tp=2)
    engine = builtin.BuiltinEngine(plan)
    engine.devices = {0: torch.device("cuda", 0), 1: torch.device("cuda", 1)}
    engine.ctx = BringUp(state=WorkerState.for_plan(plan), app=None)  # type: ignore[arg-type]
    threads = [threading.Thread(target=engine._load_rank, args=(r, LoadProgress())) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == engine.devices


def test_worker_allocates_the_staging_pool_at_start_once(
    model_dir: Path, fresh_pools: None
) -> None:
    plan = make_plan(model_dir, device="cuda", loading={"preload": {"pinned": False}})
    worker = Worker(plan)
    worker.engine = builtin.BuiltinEngine.__new__(builtin.BuiltinEngine)  # its class flag only
    thread = worker.prepare_staging()
    assert thread is not None
    thread.join()
    pool = staging.staging_pool(pinned=False)
    assert pool.geometry == staging.staging_geometry(plan)
    assert worker.prepare_staging() is None  # made once per process
    assert staging.staging_pool(pinned=False) is pool
    # Held now, so out of the available memory already: not counted again.
    cuda = {0: torch.device("cuda", 0)}
    assert host_bytes_needed(plan, cuda) == shard_index(model_dir, 0, 1).data_bytes


def test_no_pool_where_nothing_preloads_onto_cuda(model_dir: Path, fresh_pools: None) -> None:
    assert staging.prepare_staging(make_plan(model_dir, device="cpu")) is None
    direct = make_plan(model_dir, device="cuda", loading={"strategy": "Direct"})
    assert staging.prepare_staging(direct) is None
    worker = Worker(make_plan(model_dir, device="cuda"))
    worker.engine = object()  # type: ignore[assignment]  # an engine loading elsewhere (vLLM)
    assert worker.prepare_staging() is None
    assert staging._pools == {}


def test_host_memory_check_counts_the_pool_on_cuda(model_dir: Path, fresh_pools: None) -> None:
    plan = make_plan(model_dir, device="cuda")
    shards = shard_index(model_dir, 0, 1).data_bytes
    cpu, cuda = {0: torch.device("cpu")}, {0: torch.device("cuda", 0)}
    pool = staging.staging_geometry(plan, 64 << 30).nbytes
    assert pool > 0
    assert host_bytes_needed(plan, cpu, memory_limit=64 << 30) == shards
    assert host_bytes_needed(plan, cuda, memory_limit=64 << 30) == shards + pool
    # Room for the shards but not the pool as well: Direct.
    need = host_bytes_needed(plan, cuda)
    fraction = plan.loading.preload.host_memory_fraction
    fits_shards_only = int((shards + 1) / fraction) + 1
    assert need > shards
    assert choose_storage_loader(plan, cpu, available=fits_shards_only).name == "preload"
    assert choose_storage_loader(plan, cuda, available=fits_shards_only).name == "direct"
    assert choose_storage_loader(plan, cuda, available=int(need / fraction) + 2).name == "preload"
