"""Which pods join the Service (the weightlift.dev/serving label) and when their readiness gate
turns (planning._serving), what status.service says, and the pod and Service manifests.

Covers: a Source or a Target handed its weights is labelled, at creation or with its hand-off
(one patch); standby Targets and spares are not, a woken spare is with its hand-off; the gate
turns True once the probe passed and False when it fails again, once per transition; an older
revision's Ready replica stays in the Service until the rollover retires it; pods made before the
gate get no gate writes; a group's leader waits for the gate, its other pods do not;
status.service follows spec.service; the manifests. Runs in ~0.3 s."""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.support.planning import check_plan, ident, make_spec, mkpod, observe
from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    INFERENCE_PROBE_GATE,
    SERVING_LABEL,
)
from weightlift.api.model import ModelDeploymentSpec, Role, SourceEndpoint
from weightlift.api.worker import PeerHandoff, WorkerPhase, WorkerReport
from weightlift.operator.groups import render_lws
from weightlift.operator.planning import DesiredPod, ObservedPod, Plan, plan
from weightlift.operator.pods import plan_for, render_pod
from weightlift.operator.service import render_service, service_name
from weightlift.operator.serving import gate_condition

STORAGE = PeerHandoff(storage=True)
UID = "3c1f7c3e-0000-4000-8000-0000000000cc"


def run(spec: ModelDeploymentSpec, *pods: ObservedPod) -> Plan:
    observed = observe(list(pods))
    result = plan(spec, observed)
    check_plan(observed, result, spec)
    return result


def source(spec: ModelDeploymentSpec, state: str = "ready", **kw: Any) -> ObservedPod:
    """Replica 0, a Source handed storage at creation (its annotation), with the gate."""
    fields: dict[str, Any] = {"handoff": STORAGE, "probe_gate": False, **kw}
    return mkpod(spec, 0, Role.SOURCE, state=state, **fields)


def standby(spec: ModelDeploymentSpec, replica: int, **kw: Any) -> ObservedPod:
    """A Target created while no source was Ready: waiting for peers, nothing handed."""
    worker = WorkerReport(phase=WorkerPhase.STANDBY)
    return mkpod(spec, replica, Role.TARGET, state="loading", worker=worker, probe_gate=False, **kw)


# ----------------------------------------------------------------- the Service's label


def test_a_handed_source_that_lacks_the_label_gets_it() -> None:
    """Pods made before this version (or a patch lost): the label is level-triggered."""
    spec = make_spec(1)
    pod = source(spec, state="loading")
    assert run(spec, pod).serve == {pod.name}
    assert run(spec, source(spec, state="loading", serving_labelled=True)).serve == set()


def test_a_standby_target_joins_with_its_hand_off() -> None:
    spec = make_spec(2)
    src = source(spec, state="loading", serving_labelled=True)
    waiting = standby(spec, 1)
    assert run(spec, src, waiting).serve == set()  # no source Ready yet: it waits, unlabelled
    ready = source(spec, serving_labelled=True, probe_gate=True)
    result = run(spec, ready, waiting)
    assert set(result.handoff) == {waiting.name}
    assert result.serve == {waiting.name}  # the same patch as the hand-off (_patch_pods)


def test_spares_stay_out_until_a_scale_up_wakes_them() -> None:
    spec = make_spec(1, warmSpares=1)
    ready = source(spec, serving_labelled=True, probe_gate=True)
    spare = standby(spec, 1, spare=True, node="gpu-1")
    assert run(spec, ready, spare).serve == set()
    woken = run(make_spec(2, warmSpares=1), ready, spare)
    assert woken.unspare == {spare.name} and woken.serve == {spare.name}
    assert woken.handoff[spare.name].peers  # handed the Ready source in the same patch


def test_a_woken_spare_still_waiting_for_a_source_is_not_labelled_yet() -> None:
    spec = make_spec(2, warmSpares=1, initial_sources=1)
    loading = source(spec, state="loading", serving_labelled=True)
    spare = standby(spec, 1, spare=True, node="gpu-1")
    result = run(spec, loading, spare)
    assert result.unspare == {spare.name} and spare.name not in result.handoff
    assert result.serve == set()


def test_an_older_revision_serves_until_the_rollover_retires_it() -> None:
    """Zero-downtime rollout: the old Ready replica keeps its label and gate while the rollover
    keeps it for the ready count, and gets no write once it is retired (deleted)."""
    old_spec, new_spec = make_spec(1), make_spec(1, revision="v2")
    old = mkpod(
        old_spec,
        0,
        Role.SOURCE,
        handoff=STORAGE,
        serving_labelled=True,
        probe_gate=True,
    )
    new = mkpod(new_spec, 0, Role.SOURCE, state="loaded", handoff=STORAGE, probe_gate=False)
    kept = run(new_spec, old, dataclasses.replace(new, serving_labelled=True))
    assert old.name not in kept.delete and kept.gates == {} and kept.serve == set()
    ready_new = mkpod(
        new_spec, 0, Role.SOURCE, handoff=STORAGE, serving_labelled=True, probe_gate=False
    )
    retired = run(new_spec, old, ready_new)
    assert old.name in retired.delete
    assert retired.gates == {ready_new.name: True}  # the old one is deleted, not written


# ------------------------------------------------------------------------- the gate


def test_the_gate_turns_true_once_the_probe_passed() -> None:
    spec = make_spec(1)
    loaded = source(spec, state="loaded", serving_labelled=True)  # containers ready, unprobed
    assert run(spec, loaded).gates == {}
    passed = source(spec, serving_labelled=True)
    assert run(spec, passed).gates == {passed.name: True}
    # The pod shows it: nothing to write on later passes (once per transition).
    assert run(spec, source(spec, serving_labelled=True, probe_gate=True)).gates == {}


def test_the_gate_turns_false_when_the_probe_fails_again() -> None:
    spec = make_spec(1)
    failing = source(spec, state="probe-failed", serving_labelled=True, probe_gate=True)
    result = run(spec, failing)
    assert result.gates == {failing.name: False}
    assert result.serve == set()  # the label stays: its endpoint is just not ready


def test_a_pod_made_before_the_gate_gets_no_gate_writes() -> None:
    spec = make_spec(1)
    assert run(spec, source(spec, serving_labelled=True, probe_gate=None)).gates == {}


def test_terminating_pods_get_nothing() -> None:
    spec = make_spec(1)
    gone = source(spec, state="terminating", probe_gate=True)
    result = run(spec, gone)
    assert gone.name not in result.gates and gone.name not in result.serve


# ------------------------------------------------------------------------ status.service


def test_status_names_the_service_and_its_ports() -> None:
    spec = make_spec(1)
    service = run(spec).status.service
    assert service is not None
    assert (service.name, service.type, service.ports) == ("llm", "ClusterIP", "http:80/TCP")
    off = make_spec(1, service={"enabled": False})
    assert run(off).status.service is None
    node_port = make_spec(1, service={"type": "NodePort", "port": 8080})
    shown = run(node_port).status.service
    assert shown is not None and (shown.type, shown.ports) == ("NodePort", "http:8080/TCP")


def test_triton_exposes_its_own_http_and_grpc_ports_too() -> None:
    spec = make_spec(
        1,
        fmt="safetensors",
        runtime={"engine": "Triton"},
        probe={"completion": {"prompt": "hi", "expectedPrefix": "x"}},
    )
    manifest = render_service("llm", "models", UID, spec)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in manifest["spec"]["ports"]}
    rt = spec.runtime
    assert ports == {
        "http": (80, "http"),
        "triton-http": (rt.engine_port, "triton-http"),
        "triton-grpc": (rt.engine_grpc_port, "triton-grpc"),
    }


def test_service_names_are_dns_labels() -> None:
    assert service_name("llama-3") == "llama-3"
    assert service_name("3b.chat") == "md-3b-chat"


def test_the_service_selects_serving_pods_and_is_owned_by_the_deployment() -> None:
    manifest = render_service("llm", "models", UID, make_spec(1, service={"type": "LoadBalancer"}))
    assert manifest["spec"]["selector"] == {DEPLOYMENT_LABEL: "llm", SERVING_LABEL: "true"}
    assert manifest["spec"]["type"] == "LoadBalancer"
    (owner,) = manifest["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ModelDeployment",
        "llm",
        UID,
        True,
    )


# ------------------------------------------------------------------------------ the pods


def _render(spec: ModelDeploymentSpec, desired: DesiredPod) -> dict[str, Any]:
    return render_pod("llm", "models", UID, spec, desired)


def test_every_worker_pod_waits_for_the_gate_and_the_handed_ones_join_at_creation() -> None:
    spec = make_spec(3, warmSpares=1)
    identity = ident(spec)
    endpoint = SourceEndpoint(
        pod="llm-a-9", deployment="llm", address="10.0.0.10:8000", model_identity=identity
    )
    cases = {
        "source": (DesiredPod("llm-a-0", 0, Role.SOURCE, identity, []), True),
        "target with peers": (DesiredPod("llm-a-1", 1, Role.TARGET, identity, [endpoint]), True),
        "standby target": (DesiredPod("llm-a-2", 2, Role.TARGET, identity, []), False),
        "spare": (DesiredPod("llm-a-3", 3, Role.TARGET, identity, [], spare=True), False),
    }
    for case, (desired, joins) in cases.items():
        pod = _render(spec, desired)
        assert pod["spec"]["readinessGates"] == [{"conditionType": INFERENCE_PROBE_GATE}], case
        assert (pod["metadata"]["labels"].get(SERVING_LABEL) == "true") is joins, case


def test_a_groups_leader_waits_for_the_gate_its_other_pods_do_not() -> None:
    """Only the leader answers the API (the others 421): it alone may be an endpoint."""
    spec = make_spec(2, tensor=2, parallelism={"tensor": 2, "podsPerReplica": 2})
    identity = ident(spec)
    group = DesiredPod("llm-0", 0, Role.SOURCE, identity, [])
    lws = render_lws("llm", "models", UID, spec, group, plan_for("llm", "models", spec, identity))
    templates = lws["spec"]["leaderWorkerTemplate"]
    leader, others = templates["leaderTemplate"], templates["workerTemplate"]
    assert leader["spec"]["readinessGates"] == [{"conditionType": INFERENCE_PROBE_GATE}]
    assert "readinessGates" not in others["spec"]
    # Otherwise one pod: the same labels (none serving yet: the role comes with the hand-off).
    assert {**leader["spec"], "readinessGates": None} == {**others["spec"], "readinessGates": None}
    assert leader["metadata"] == others["metadata"]
    assert SERVING_LABEL not in leader["metadata"]["labels"]


def test_the_gate_condition_says_what_it_means() -> None:
    up, down = gate_condition(True), gate_condition(False)
    assert (up["type"], up["status"], up["reason"]) == (
        INFERENCE_PROBE_GATE,
        "True",
        "InferenceProbePassed",
    )
    assert down["status"] == "False" and down["lastTransitionTime"]
