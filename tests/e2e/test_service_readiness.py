"""Ready means probed (issue 45), on the process node: its pods' Ready honours readiness gates
as the kubelet's does, so a worker pod is Ready only while its inference probe passes
(tests/support/endpoints.py holds the moment with a probe that cannot pass). The process node's
pod IPs are loopback addresses, which an EndpointSlice may not hold: the EndpointSlice half runs
on the real node (test_kubelet_service_readiness.py). ~25 s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.e2e import READY_TIMEOUT
from tests.support.endpoints import check_ready_only_after_probe
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack

JSON = dict[str, Any]


def test_the_endpoint_is_ready_only_while_the_probe_passes(
    stack: LocalStack,
    deployments: Callable[..., Observer],
    demo_model: tuple[Path, JSON],
) -> None:
    model_dir, probe = demo_model
    check_ready_only_after_probe(
        stack, deployments, "gated", model_dir, probe, READY_TIMEOUT, slices=False
    )
