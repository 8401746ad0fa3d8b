"""UCX_TLS values that would make same-host pulls slow or impossible are named; UCX's own choice
(unset) and lists that keep cma (or RDMA) and an active-message transport are left alone."""

from __future__ import annotations

import pytest

from weightlift.worker.p2p.transport import transport_warning


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
