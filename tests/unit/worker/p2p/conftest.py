from __future__ import annotations

from pathlib import Path

import pytest

from weightlift.local.sharded import write_sharded_model
from weightlift.worker.p2p import faultgate


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4 MB fp16 model presharded for 2 ranks."""
    d = tmp_path_factory.mktemp("p2p-model")
    write_sharded_model(d, size_mb=4, tensor_parallel=2)
    return d


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fault gate's folder for this test, on a process node (worker/p2p/faultgate.py)."""
    folder = tmp_path / "gate"
    monkeypatch.setenv(faultgate.GATE_DIR_ENV, str(folder))
    monkeypatch.setenv(faultgate.PROCESS_NODE_ENV, "test-node")
    return folder
