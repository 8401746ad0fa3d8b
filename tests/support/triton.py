"""The real tritonserver (nvidia-pytriton's) for tests: its install, found or skipped.

`make test` builds it (hack/install-triton.sh through `make triton-env`) and sets
WEIGHTLIFT_REQUIRE_TRITON: then a missing install fails the Triton tests instead of skipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightlift.worker.engines.triton.install import (
    TritonMissing,
    backend_dir,
    engine_python_info,
    server_root,
    stub_site,
    triton_home,
)

REQUIRE_ENV = "WEIGHTLIFT_REQUIRE_TRITON"


def triton_worker_env() -> dict[str, str]:
    """What worker processes need to find tritonserver (spec env may not name WEIGHTLIFT_*)."""
    return {"WEIGHTLIFT_TRITON_HOME": str(triton_home())}


def require_triton_home(python: Path) -> Path:
    """The install's home (WEIGHTLIFT_TRITON_HOME for workers), complete for `python`'s stub."""
    home = triton_home()
    try:
        version = engine_python_info(str(python)).version
        backend_dir(server_root(home), version)
        stub_site(version, home)
    except TritonMissing as exc:
        msg = f"{exc}; run `make triton-env`"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{msg} [{REQUIRE_ENV} is set]", pytrace=False)
        pytest.skip(msg)
    return home
