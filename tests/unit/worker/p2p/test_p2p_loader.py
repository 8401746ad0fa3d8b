"""PeerToPeerLoader edges that need no peer: no candidates, options from the plan, NIXL import."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.p2p import require_nixl
from weightlift.api.worker import PeerCandidate
from weightlift.local.sharded import make_plan
from weightlift.worker.loaders.p2p import PeerToPeerLoader, options_for
from weightlift.worker.p2p.nixl_compat import nixl
from weightlift.worker.weights.progress import LoadError, LoadProgress


def test_no_peers_is_load_error(model_dir: Path) -> None:
    plan = make_plan(model_dir, pod="t")
    with pytest.raises(LoadError, match="rank 0: no peer candidates"):
        PeerToPeerLoader().load(plan, 0, torch.device("cpu"), LoadProgress())


def test_unreachable_peers_fail_fast_with_every_reason(model_dir: Path) -> None:
    peers = [PeerCandidate(pod=f"gone-{i}", address=f"127.0.0.1:{9 + i}") for i in range(2)]
    plan = make_plan(model_dir, pod="t", peers=peers)
    progress = LoadProgress()
    with pytest.raises(LoadError, match="all 2 peer") as err:
        PeerToPeerLoader().load(plan, 0, torch.device("cpu"), progress)
    assert "gone-0" in str(err.value) and "gone-1" in str(err.value)
    assert progress.loaded_from is None


def test_options_from_plan_and_caller(model_dir: Path) -> None:
    plan = make_plan(model_dir, pod="t", transfer_timeout_seconds=3, max_in_flight=5)
    opts = options_for(plan)
    assert opts.transfer_timeout_s == 3 and opts.max_in_flight == 5
    assert opts.stall_seconds == 3  # never longer than the deadline
    assert opts.throttle_s == 0 and opts.batch_bytes == 64 << 20
    opts = options_for(plan, batch_bytes=4 << 20, throttle_s=0.25)
    assert opts.throttle_s == 0.25 and opts.batch_bytes == 4 << 20


def test_nixl_importable_here() -> None:
    """Skips where NIXL does not import; fails there when WEIGHTLIFT_REQUIRE_NIXL is set (as
    `make test` does)."""
    require_nixl()
    mod = nixl()
    assert hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config")
