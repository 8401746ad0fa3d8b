"""`weightlift bench chaos`'s own logic, without a stack: the other weights the standby
scenarios swap in must be told apart by the probe alone, and a wait for a source that runs out
before any Target waited is reported as such (not blamed on the operator)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from safetensors.torch import load_file

from weightlift.bench.chaos import SCENARIOS
from weightlift.bench.chaos_models import Models
from weightlift.bench.chaos_run import Run, outputs_match
from weightlift.bench.chaos_standby import SHORT_WAIT_SECONDS, _standby_before_expiry
from weightlift.local.models import make_demo
from weightlift.worker.engines.builtin.runtime import Pt2Runtime

JSON = dict[str, Any]


def _answer(model: Path, probe: JSON) -> list[JSON]:
    """What `model`'s program and weights answer to `probe`'s request (KServe v2 outputs)."""
    rt = Pt2Runtime.open(model)
    rt.bind({0: load_file(str(model / "model.safetensors"))})  # at the file's offsets
    request = probe["request"]["inputs"][0]
    x = np.array(request["data"], dtype=np.float32).reshape(request["shape"])
    y = rt.infer({"INPUT0": x})["OUTPUT0"]
    return [{"name": "OUTPUT0", "shape": list(y.shape), "data": y.flatten().tolist()}]


def test_the_alternate_weights_fit_the_program_but_fail_the_probe(tmp_path: Path) -> None:
    good = tmp_path / "good"
    make_demo(good, size_mb=1, hook=False, seed=0)
    models = Models(tmp_path, good=good)
    alt, alt_probe = models.alt()
    good_t = load_file(str(good / "model.safetensors"))
    alt_t = load_file(str(alt / "model.safetensors"))
    assert {k: v.shape for k, v in good_t.items()} == {k: v.shape for k, v in alt_t.items()}
    assert any(not good_t[k].equal(alt_t[k]) for k in good_t)
    # Each model passes its own probe and fails the other's: the watcher can tell them apart.
    assert outputs_match(_answer(good, models.probe), models.probe)
    assert outputs_match(_answer(alt, alt_probe), alt_probe)
    assert not outputs_match(_answer(alt, models.probe), models.probe)
    assert not outputs_match(_answer(good, alt_probe), alt_probe)
    # A second call reuses what the first made.
    assert models.alt() == (alt, alt_probe)


def test_alternate_weights_of_other_shapes_are_refused(tmp_path: Path) -> None:
    good = tmp_path / "good"
    make_demo(good, size_mb=1, hook=False, seed=0)
    make_demo(tmp_path / "alt", size_mb=2, hook=False, seed=11)  # a stale, other-sized one
    with pytest.raises(RuntimeError, match="tensor shapes differ"):
        Models(tmp_path, good=good).alt()


class _Rows:
    """Just enough of a Run for `_standby_before_expiry`: the status's replica rows."""

    def __init__(self, rows: list[JSON]) -> None:
        self.rows = rows

    def replicas(self) -> list[JSON]:
        return self.rows


def test_a_wait_that_ran_out_before_standby_says_so() -> None:
    source = {"name": "d-abc-0", "replica": 0, "role": "Source", "phase": "Loading"}
    waiting = {"name": "d-abc-1", "replica": 1, "role": "Target", "phase": "Standby"}
    starting = {"name": "d-abc-1", "replica": 1, "role": "Target", "phase": "InitHooks"}
    relabelled = {"name": "d-abc-1", "replica": 1, "role": "Source", "phase": "Loading"}
    assert _standby_before_expiry(cast(Run, _Rows([source, waiting])))
    assert not _standby_before_expiry(cast(Run, _Rows([source, starting])))
    with pytest.raises(AssertionError, match=f"{SHORT_WAIT_SECONDS}s wait ran out.*d-abc-1"):
        _standby_before_expiry(cast(Run, _Rows([source, relabelled])))


def test_standby_scenarios_end_serving_and_check_what_they_are_about() -> None:
    standby = [s for s in SCENARIOS if s.name.startswith("standby-")]
    assert len(standby) == 5
    for s in standby:
        assert s.refuses is None and s.replicas >= 2 and s.verify is not None, s.name
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names))


def test_mid_pull_faults_strike_a_held_pull_and_check_it() -> None:
    """The faults that must land mid-pull wait on the fault gate, not on a status poll, and
    check afterwards that they hit that pull; `make test` runs one of them."""
    from weightlift.bench import chaos_pull

    mid_pull = {
        "source-sigkill-while-pulling": chaos_pull.verify_peer_fault,
        "source-sigstop-while-pulling": chaos_pull.verify_peer_fault,
        "node-lost-and-back": chaos_pull.verify_node_lost,
    }
    by_name = {s.name: s for s in SCENARIOS}
    for name, verify in mid_pull.items():
        assert by_name[name].verify is verify and by_name[name].replicas >= 2, name
    assert by_name["source-sigkill-while-pulling"].fast
