"""`weightlift bench chaos`'s own logic, without a stack: the other weights the standby
scenarios swap in must be told apart by the probe alone, a wait for a source that runs out
before any Target waited is reported as such (not blamed on the operator), and each damage the
compile-store scenarios do to a store entry is refused by the real store with the reason the
scenario then expects in the replica's compileCache."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.unit.worker.test_compile_store import WANTED, installed_files, packed
from weightlift.bench import chaos_store
from weightlift.bench.chaos import SCENARIOS, Result, render
from weightlift.bench.chaos_models import Models
from weightlift.bench.chaos_run import Run, outputs_match
from weightlift.bench.chaos_standby import SHORT_WAIT_SECONDS, _standby_before_expiry
from weightlift.local.models import make_demo
from weightlift.worker.engines.builtin.runtime import Pt2Runtime
from weightlift.worker.engines.vllm.compile_store import NodeStore

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


def test_store_scenarios_deploy_vllm_never_in_make_test_and_name_their_fault() -> None:
    """The compile-store scenarios (vLLM only, minutes each) stay out of `make test`'s subset
    and end with one replica Ready and a check of what they are about."""
    store = {s.name: s for s in SCENARIOS if s.name.startswith("store-")}
    assert sorted(store) == sorted(
        [d.name for d in chaos_store.DAMAGES]
        + ["store-read-only", "store-full", "store-s3-credentials-refused"]
    )
    for s in store.values():
        assert s.vllm and not s.fast and s.replicas == 1 and s.verify is not None, s.name
        assert s.timeout >= chaos_store.READY_TIMEOUT, s.name
    assert not any(s.vllm for s in SCENARIOS if not s.name.startswith("store-"))


@pytest.mark.parametrize("damage", chaos_store.DAMAGES, ids=lambda d: d.name)
def test_each_entry_damage_is_refused_with_the_reason_its_scenario_expects(
    tmp_path: Path, damage: chaos_store.Damage
) -> None:
    """The damage as the scenario does it (to a real entry, in the node store's layout): the
    store installs nothing and its reason carries every fragment the scenario asserts on; a
    refused entry is dropped, an unreadable one left for the replica's write to replace."""
    store = NodeStore(tmp_path / "store", 1 << 20)
    store.put({0: packed(tmp_path)})
    (entry,) = chaos_store.store_entries(store.root)
    damage.apply(store.root, entry)
    root = tmp_path / "replica"
    got = store.install([WANTED], root)
    assert got.vllm_hash is None and not got.files, got
    assert all(n in got.reason for n in damage.names), (damage.names, got.reason)
    assert not root.exists() or installed_files(root) == []
    assert (not any(store.root.glob("*/*"))) == damage.dropped, list(store.root.glob("*/*"))


def test_a_repeated_scenario_reports_k_of_n_and_the_spread_of_its_seconds() -> None:
    def result(converged: bool, seconds: float | None, orphans: int = 0) -> Result:
        return Result("leader-sigkill", converged, seconds, orphans, 0, "takeover")

    runs = [result(True, 20.0), result(True, 24.0), result(False, None), result(True, 22.0, 1)]
    text = render([*runs, Result("once", True, 5.0, 0, 0, "")])
    assert "leader-sigkill: 2/4 converged clean; seconds median 22.0 (20.0-24.0)" in text
    assert "once:" not in text  # one run: no repeat line


def test_group_scenarios_deploy_groups_and_check_what_they_are_about() -> None:
    """The four group faults of issue 47 run as scenarios of 2-pod replicas (the stack then
    runs the LWS controller); one is in `make test`'s subset."""
    from weightlift.bench import chaos_groups

    groups = {s.name: s for s in SCENARIOS if s.pods > 1}
    assert sorted(groups) == sorted(g.name for g in chaos_groups.SCENARIOS)
    assert len(groups) == 4
    for s in groups.values():
        assert s.pods == chaos_groups.PODS == chaos_groups.PARALLELISM["podsPerReplica"]
        assert s.replicas >= 1 and s.refuses is None and s.verify is not None, s.name
        assert not s.vllm and not s.spares, s.name
    assert [s.name for s in groups.values() if s.fast] == ["group-source-pod-sigkill-mid-pull"]
    assert all(s.pods == 1 for s in SCENARIOS if s.name not in groups)


def test_the_watcher_probes_a_group_through_its_leader() -> None:
    from weightlift.bench.chaos_run import serving_pod

    group = {
        "name": "d-abc123-1",
        "podIP": "10.0.0.5",
        "pods": [{"name": "d-abc123-1-0", "index": 0}, {"name": "d-abc123-1-0-1", "index": 1}],
    }
    assert serving_pod(group) == "d-abc123-1-0"
    assert serving_pod({"name": "d-abc123-0", "podIP": "10.0.0.4"}) == "d-abc123-0"


class _Node:
    def __init__(self, pods: list[str]) -> None:
        self._pids = {f"default/{p}": [100 + i] for i, p in enumerate(pods)}

    def pids(self) -> dict[str, list[int]]:
        return self._pids


class _Stack:
    """Just enough of a LocalStack for `Run.converged`: one ModelDeployment and its pods."""

    def __init__(self, md: JSON, pods: list[str]) -> None:
        self.md, self.names = md, pods
        self.node = _Node(pods)

    def get_md(self, name: str) -> JSON:
        return self.md

    def pods(self, name: str) -> list[JSON]:
        return [{"metadata": {"name": p}} for p in self.names]


def test_converged_counts_every_pod_of_each_group() -> None:
    """Two Ready groups of two pods: converged with 4 pods and processes, not with 2 (a group
    short of a pod) nor 6 (a group left over)."""
    rows = [{"name": f"d-abc123-{i}", "ready": True, "phase": "Ready"} for i in range(2)]
    md = {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "phase": "Ready",
            "readyReplicas": 2,
            "replicaStatuses": rows,
        },
    }
    pods = [f"d-abc123-{i}-0{tail}" for i in range(2) for tail in ("", "-1")]

    def converged(names: list[str]) -> bool:
        run = Run(cast(Any, _Stack(md, names)), cast(Any, None), "d")
        return run.converged(2, 0, pods_per_replica=2)

    assert converged(pods)
    assert not converged(pods[:3])
    assert not converged([*pods, "d-abc123-2-0", "d-abc123-2-0-1"])
    assert not Run(cast(Any, _Stack(md, pods)), cast(Any, None), "d").converged(2)
