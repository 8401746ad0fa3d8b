from __future__ import annotations

from pathlib import Path

import pytest

from weightlift.local.sharded import write_sharded_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4 MB fp16 model presharded for 2 ranks."""
    d = tmp_path_factory.mktemp("p2p-model")
    write_sharded_model(d, size_mb=4, tensor_parallel=2)
    return d
