"""UCX_TLS values that would make same-host pulls slow or impossible are named; UCX's own choice
(unset) and lists that keep cma (or RDMA) and an active-message transport are left alone. Hosts
without RDMA devices skip UCX's memory hooks (unless the user set the hook mode); hosts with
them keep UCX's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.p2p import needs_nixl
from weightlift.worker.p2p import transport
from weightlift.worker.p2p.transport import (
    apply_ucx_defaults,
    rdma_devices,
    transport_warning,
    ucx_defaults,
)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "tcp,cma",
        "cma,tcp",
        "shm,tcp",
        "sm,tcp",
        "rc,cma",
        "rc,tcp",
        "all",
        "^ud",
        "tcp,cma,self",
    ],
)
def test_fast_or_unset_transports_pass(value: str) -> None:
    assert transport_warning({"UCX_TLS": value} if value else {}) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("tcp", "leaves out cma"),
        ("tcp,self", "leaves out cma"),
        ("^cma", "excludes cma"),
        ("^shm", "excludes cma"),
        ("sm", "NIXL agents will fail"),
        ("posix,cma", "NIXL agents will fail"),
        ("cma", "NIXL agents will fail"),
    ],
)
def test_slow_or_broken_transports_named(value: str, says: str) -> None:
    warning = transport_warning({"UCX_TLS": value})
    assert warning is not None and says in warning and f"UCX_TLS={value}" in warning


def test_rdma_devices_listed_from_sysfs(tmp_path: Path) -> None:
    ib, verbs = tmp_path / "infiniband", tmp_path / "infiniband_verbs"
    assert rdma_devices((ib, verbs)) == []
    (ib / "mlx5_1").mkdir(parents=True)
    (ib / "mlx5_0").mkdir()
    assert rdma_devices((ib, verbs)) == ["mlx5_0", "mlx5_1"]
    (verbs / "uverbs0").mkdir(parents=True)
    assert rdma_devices((verbs,)) == ["uverbs0"]


def test_no_rdma_host_skips_ucx_memory_hooks() -> None:
    assert ucx_defaults({}, rdma=[]) == {"UCX_MEM_MMAP_HOOK_MODE": "none"}


def test_rdma_host_keeps_ucx_defaults() -> None:
    # Registration caches need the memory hooks: with RDMA devices nothing is changed.
    assert ucx_defaults({}, rdma=["mlx5_0"]) == {}


def test_users_own_hook_mode_wins() -> None:
    assert ucx_defaults({"UCX_MEM_MMAP_HOOK_MODE": "bistro"}, rdma=[]) == {}


def test_apply_adds_only_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "rdma_devices", lambda: [])
    env = {"UCX_TLS": "tcp,cma"}
    assert apply_ucx_defaults(env) == {"UCX_MEM_MMAP_HOOK_MODE": "none"}
    assert env == {"UCX_TLS": "tcp,cma", "UCX_MEM_MMAP_HOOK_MODE": "none"}
    assert apply_ucx_defaults(env) == {}


_MAKE_AGENT = """
import json, os
from weightlift.worker.p2p.nixl_compat import nixl
mod = nixl()
agent = mod.nixl_agent("t", mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
print(json.dumps([os.environ.get("UCX_MEM_MMAP_HOOK_MODE"), sorted(agent.backends)]))
del agent
"""


@needs_nixl
@pytest.mark.parametrize("user_mode", [None, "reloc"])
def test_real_agent_made_with_the_defaults(user_mode: str | None) -> None:
    """A fresh process (UCX loads once per process): NIXL's UCX backend comes up with the
    default this host gets, or with the user's own hook mode untouched."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_MEM_MMAP_HOOK_MODE"}
    if user_mode is not None:
        env["UCX_MEM_MMAP_HOOK_MODE"] = user_mode
    out = subprocess.run(
        [sys.executable, "-c", _MAKE_AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected = user_mode or (None if rdma_devices() else "none")
    assert json.loads(out.stdout.splitlines()[-1]) == [expected, ["UCX"]]
