"""The lifecycle a user sees, for real: pods are processes, weights move over P2P, probes are real
inference requests, READY means the model answered correctly."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cluster import wait_for
from tests.support.e2e import READY_TIMEOUT, alive, fault_gate, pids_of, wait_gone
from weightlift.api.labels import TEMPLATE_LABEL
from weightlift.local.history import History, Version
from weightlift.local.kube import delete
from weightlift.local.observe import Observer, infer
from weightlift.local.stack import LocalStack
from weightlift.worker.p2p import faultgate

JSON = dict[str, Any]
Deploy = Callable[..., Observer]


def _endpoint(obs: Observer, replica_name: str) -> str:
    for r in obs.summary()["replicas"]:
        if r["name"] == replica_name:
            endpoint: str = r["endpoint"]
            return endpoint
    raise AssertionError(f"{replica_name} has no endpoint")


def _assert_expected(outputs: list[JSON], probe: JSON) -> None:
    expected = probe["expectedOutputs"][0]
    got = {o["name"]: o for o in outputs}[expected["name"]]
    assert got["shape"] == expected["shape"]
    worst = max(
        abs(float(a) - float(b)) for a, b in zip(got["data"], expected["data"], strict=True)
    )
    assert worst <= probe["tolerance"], f"output differs from expected by {worst}"


def _ready_rows(obs: Observer) -> list[JSON]:
    return [r for r in obs.replica_statuses() if r.get("ready")]


def test_three_replicas_one_source_two_p2p_targets_then_scale_and_delete(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON], hook_log: Path
) -> None:
    model_dir, probe = demo_model
    hook_lines_before = _hook_inits(hook_log)
    obs = deployments("life", model_dir, probe, replicas=3)
    obs.wait_ready(READY_TIMEOUT)

    rows = obs.replica_statuses()
    assert len(rows) == 3 and all(r["ready"] for r in rows)
    sources = [r for r in rows if r["loadedFrom"] == "storage:hostpath"]
    targets = [r for r in rows if str(r["loadedFrom"]).startswith("peer:")]
    assert len(sources) == 1, rows
    assert sources[0]["role"] == "Source"
    assert len(targets) == 2, rows
    source_pods = {r["name"] for r in rows}
    for t in targets:
        assert t["role"] == "Target"
        assert t["loadedFrom"].removeprefix("peer:") in source_pods
        # UCX's own name for how the rank's bytes moved: processes of one host, host memory.
        (moved,) = t["transports"]
        assert moved["rank"] == 0 and moved["transport"].split("/")[0] in ("cma", "sysv", "posix")
        assert "(zero-copy)" in moved["transport"] and not moved.get("note"), moved
    assert all(not r.get("transports") for r in sources)
    assert all(r["hooksRun"] for r in rows)
    assert all(r["bytesLoaded"] == r["bytesTotal"] > 0 for r in rows)
    # The C init hook really ran in each worker process (it appends to WEIGHTLIFT_HOOK_LOG).
    assert _hook_inits(hook_log) - hook_lines_before >= 3
    cond = obs.condition("Ready")
    assert cond is not None and cond["status"] == "True"

    # Same input through every endpoint: identical outputs, equal to the expected output.
    outputs = [infer(_endpoint(obs, r["name"]), "life", probe["request"])["outputs"] for r in rows]
    assert all(o == outputs[0] for o in outputs)
    _assert_expected(outputs[0], probe)
    # Every replica has its own loopback address.
    endpoints = {_endpoint(obs, r["name"]) for r in rows}
    assert len(endpoints) == 3

    # Scale 3 -> 5 through the scale subresource: the new replicas load peer to peer.
    before = {r["name"] for r in rows}
    stack.scale_md("life", 5)
    obs.wait(
        lambda o: len(_ready_rows(o)) == 5 and o.phase() == "Ready",
        READY_TIMEOUT,
        "5 ready replicas",
    )
    new = [r for r in obs.replica_statuses() if r["name"] not in before]
    assert len(new) == 2
    for r in new:
        assert r["role"] == "Target", r
        assert str(r["loadedFrom"]).startswith("peer:"), r
    outputs5 = [
        infer(_endpoint(obs, r["name"]), "life", probe["request"])["outputs"]
        for r in obs.replica_statuses()
    ]
    assert all(o == outputs[0] for o in outputs5)

    # Delete: every pod and every worker process goes away.
    pids = pids_of(stack, "life")
    assert len(pids) == 5 and all(alive(p) for p in pids)
    stack.delete_md("life")
    wait_gone(stack, "life", pids)


def test_source_deleted_while_target_pulls(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """The source freezes (SIGSTOP) as the target starts pulling and is then deleted: the target
    must fall back or re-select, and still serve exactly the right weights."""
    model_dir, probe = demo_model
    obs = deployments("flaky", model_dir, probe, replicas=1)
    obs.wait_ready(READY_TIMEOUT)
    source = obs.replica_statuses()[0]["name"]
    source_uid = obs.pods[0]["metadata"]["uid"]
    source_pids = stack.node.pids()[f"{stack.namespace}/{source}"]
    assert source_pids

    # The process node's fault gate holds the target's pull once its first READ from the source
    # landed (worker/p2p/faultgate.py): the freeze lands mid-pull however fast the machine.
    gate = fault_gate(stack)
    faultgate.arm(gate, "flaky")
    try:
        stack.patch_md(
            "flaky",
            {"spec": {"replicas": 2, "loading": {"peerToPeer": {"transferTimeoutSeconds": 3}}}},
        )
        held = wait_for(lambda: faultgate.holding(gate, "flaky"), READY_TIMEOUT, "a held pull")
        assert held.peer == source and held.in_flight, held
        target = held.pod
        for pid in source_pids:
            os.kill(pid, signal.SIGSTOP)
    finally:
        faultgate.disarm(gate, "flaky")  # the pull goes on against the frozen source
    delete(stack.kube.core.delete_namespaced_pod, source, stack.namespace, grace_period_seconds=1)
    # The replacement of the deleted pod may reuse its name: tell them apart by uid.
    obs.wait(
        lambda o: (
            len(_ready_rows(o)) == 2
            and len(o.pods) == 2
            and all(p["metadata"]["uid"] != source_uid for p in o.pods)
        ),
        READY_TIMEOUT,
        "2 ready replicas without the deleted source",
    )
    rows = {r["name"]: r for r in obs.replica_statuses()}
    # The frozen source could not serve the target: it fell back to storage (verified load).
    assert rows[target]["loadedFrom"] == "storage:hostpath", rows[target]
    for r in rows.values():
        outputs = infer(_endpoint(obs, r["name"]), "flaky", probe["request"])["outputs"]
        _assert_expected(outputs, probe)
    assert not any(alive(p) for p in source_pids)


def test_wrong_probe_expectation_stays_not_ready(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    wrong = {**probe, "expectedOutputs": [dict(probe["expectedOutputs"][0])]}
    wrong["expectedOutputs"][0]["data"] = [v + 1.0 for v in probe["expectedOutputs"][0]["data"]]
    # Every version of the deployment, from before its apply: a replica marked Ready at any
    # moment is one of them, however briefly it lasted (readyReplicas is written at once).
    with History.deployment(stack.kubeconfig, stack.namespace, "wrongprobe") as history:
        deployments("wrongprobe", model_dir, wrong, replicas=1)
        failed = history.wait(
            lambda v: _probe_failures(v) >= 3,
            READY_TIMEOUT,
            "the inference probe to fail 3 times",
            tick=stack.check_operator,
        )
        # "It stays not Ready" for as long as the status proves: 3 more failed probes counted,
        # each one more chance to mark it Ready (not a sleep that may pass without a probe).
        later = history.wait(
            lambda v: _probe_failures(v) >= _probe_failures(failed) + 3,
            READY_TIMEOUT,
            "3 more failed probes",
            tick=stack.check_operator,
        )
        versions = history.upto(later)
    for v in versions:
        status, rows = v.status, _rows(v)
        conditions: list[JSON] = status.get("conditions") or []
        ready = next((c for c in conditions if c.get("type") == "Ready"), {})
        assert (
            int(status.get("readyReplicas") or 0) == 0
            and not any(r.get("ready") for r in rows)
            and status.get("phase") != "Ready"
            and ready.get("status") != "True"
            and not status.get("sources")  # a replica that fails probes must not be a source
        ), f"version {v.rv} ({v.type}) marks the failing replica Ready: {status}"
    row = later.status["replicaStatuses"][0]
    assert row["ready"] is False
    assert row["probe"]["passed"] is False
    assert "differs from expected" in row["probe"]["message"]
    assert row.get("hooksRun") is True and row["bytesLoaded"] == row["bytesTotal"] > 0
    ready = next(c for c in later.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"]
    # Events are records too: the operator never announced the phase Ready.
    reasons = [e["reason"] for e in stack.events("wrongprobe")]
    assert "PhaseReady" not in reasons, reasons


def _rows(version: Version) -> list[JSON]:
    rows: list[JSON] = version.status.get("replicaStatuses") or []
    return rows


def _probe_failures(version: Version) -> int:
    rows = _rows(version)
    return int(((rows[0].get("probe") or {}) if rows else {}).get("consecutiveFailures") or 0)


def test_missing_init_symbol_fails_naming_library_and_symbol(
    deployments: Deploy, bad_hook_model: Path, demo_model: tuple[Path, JSON]
) -> None:
    _, probe = demo_model
    obs = deployments("badhook", bad_hook_model, probe, replicas=1, hook_library="hooks/libbad.so")
    obs.wait(lambda o: o.phase() == "Failed", READY_TIMEOUT, "phase Failed")
    texts = [
        str(obs.status().get("message", "")),
        *(str(r.get("message", "")) for r in obs.replica_statuses()),
        *(str(c.get("message", "")) for c in obs.status().get("conditions", [])),
    ]
    blob = "\n".join(texts)
    assert "libbad.so" in blob and "triton_pytorch_model_init" in blob, blob
    assert int(obs.status().get("readyReplicas", 0)) == 0


def test_new_revision_rolls_over_without_dropping_to_zero_ready(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    obs = deployments("roll", model_dir, probe, replicas=2, revision="1")
    obs.wait_ready(READY_TIMEOUT)
    old_identity = obs.status()["modelIdentity"]
    old_pods = {r["name"] for r in obs.replica_statuses()}

    def rolled(o: Observer) -> bool:
        rows = o.replica_statuses()
        return (
            o.status().get("modelIdentity") not in (None, old_identity)
            and o.phase() == "Ready"
            and len(rows) == 2
            and all(r["ready"] and r["modelIdentity"] != old_identity for r in rows)
            and not any(p["metadata"]["name"] in old_pods for p in o.pods)
        )

    # Every version of the deployment from before the patch until the rolled one: a dip of
    # readyReplicas is one of them, however briefly it lasted (it is written at once).
    with History.deployment(stack.kubeconfig, stack.namespace, "roll") as history:
        stack.patch_md("roll", {"spec": {"model": {"revision": "2"}}})
        obs.wait(rolled, READY_TIMEOUT * 2, "rollover to revision 2")
        assert obs.md is not None
        versions = history.through(obs.md, tick=stack.check_operator)
    identities = [v.status.get("modelIdentity") for v in versions]
    assert identities[0] == old_identity and identities[-1] != old_identity, identities
    dips = [
        (v.rv, v.status.get("readyReplicas"), [r.get("ready") for r in _rows(v)])
        for v in versions
        if int(v.status.get("readyReplicas") or 0) < 1 or not any(r.get("ready") for r in _rows(v))
    ]
    assert not dips, f"no replica Ready during the rollover (rv, readyReplicas, rows): {dips}"
    for r in obs.replica_statuses():
        outputs = infer(_endpoint(obs, r["name"]), "roll", probe["request"])["outputs"]
        _assert_expected(outputs, probe)


def test_a_template_change_rolls_onto_new_pods_that_pull_from_the_old_ones(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """A change to spec.template (here its env) rolls the replicas as a Deployment would: new
    pods, made from the new template, pull the weights from the old ones over P2P (the model
    identity is the same), and the old ones retire as the new pass their probes."""
    model_dir, probe = demo_model
    obs = deployments("tmpl", model_dir, probe, replicas=2)
    obs.wait_ready(READY_TIMEOUT)
    identity = obs.status()["modelIdentity"]
    old = {p["metadata"]["labels"][TEMPLATE_LABEL] for p in obs.pods}
    assert len(old) == 1, old

    def rolled(o: Observer) -> bool:
        rows = o.replica_statuses()
        made = {p["metadata"]["labels"].get(TEMPLATE_LABEL) for p in o.pods}
        done = o.phase() == "Ready" and len(rows) == 2 and all(r["ready"] for r in rows)
        return done and len(o.pods) == 2 and not made & old

    with History.deployment(stack.kubeconfig, stack.namespace, "tmpl") as history:
        env = [{"name": "ROLL_REVISION", "value": "2"}]
        stack.patch_md("tmpl", {"spec": {"template": {"env": env}}})
        obs.wait(rolled, READY_TIMEOUT * 2, "rollout onto the new pod template")
        assert obs.md is not None
        versions = history.through(obs.md, tick=stack.check_operator)
    dips = [
        (v.rv, v.status.get("readyReplicas"))
        for v in versions
        if int(v.status.get("readyReplicas") or 0) < 1
    ]
    assert not dips, f"no replica Ready during the rollout (rv, readyReplicas): {dips}"
    assert obs.status()["modelIdentity"] == identity
    rows = obs.replica_statuses()
    assert all(str(r["loadedFrom"]).startswith("peer:") for r in rows), rows
    for pod in obs.pods:
        (worker,) = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
        assert {"name": "ROLL_REVISION", "value": "2"} in worker["env"], worker["env"]
    for r in rows:
        outputs = infer(_endpoint(obs, r["name"]), "tmpl", probe["request"])["outputs"]
        _assert_expected(outputs, probe)


def _hook_inits(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.startswith("init "))
    except OSError:
        return 0
