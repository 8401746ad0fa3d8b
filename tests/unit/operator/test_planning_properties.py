"""Property tests: plan() over random observed states, and random reconcile sequences."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.planning import (
    NAME,
    T0,
    Cluster,
    check_plan,
    ident,
    make_spec,
    mkpod,
    observe,
    sibling,
)
from weightlift.api.model import ModelDeploymentSpec, ModelDeploymentStatus, Phase, Role
from weightlift.api.times import rfc3339
from weightlift.operator.identity import pod_template_revision
from weightlift.operator.planning import Observed, ObservedPod, Plan, Revision, plan, validate

OLD_TEMPLATE = "0ld0ld0ld0"  # a pod made from another pod template
STATES = ["pending", "scheduled", "loading", "loaded", "probe-failed", "ready", "failed", "broken"]
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIM = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw: st.DrawFn) -> ModelDeploymentSpec:
    strategy = draw(st.sampled_from(["Auto", "PeerToPeer", "Preload", "Direct"]))
    pulls = strategy in ("Auto", "PeerToPeer")  # spares wait to be handed peers
    return make_spec(
        draw(st.integers(0, 6)),
        revision=draw(st.sampled_from(["main", "v2"])),
        tensor=draw(st.sampled_from([1, 1, 2])),
        strategy=strategy,
        initial_sources=draw(st.integers(1, 3)),
        wait=draw(st.sampled_from([0, 60, 300])),
        max_surge=draw(st.integers(1, 3)),
        warmSpares=draw(st.sampled_from([0, 0, 1, 2])) if pulls else 0,
    )


OTHER_IDENTITIES = [ident(make_spec(1, revision="main")), ident(make_spec(1, revision="v2"))]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[ModelDeploymentSpec, Observed]:
    spec = draw(specs())
    identity = ident(spec)
    identities = sorted({identity, *OTHER_IDENTITIES, identity[:6] + "0" * 10})
    # None: made by an older version (adopted when its identity is current).
    templates = [None, pod_template_revision(spec), OLD_TEMPLATE]
    pods: dict[str, ObservedPod] = {}
    for _ in range(draw(st.integers(0, 9))):
        pod = mkpod(
            draw(st.sampled_from(identities)),
            draw(st.integers(0, 7)),
            role := draw(st.sampled_from([Role.SOURCE, Role.TARGET])),
            state=draw(st.sampled_from(STATES)),
            terminating=draw(st.integers(0, 9)) == 0,
            # A spare is created a Target and loses its label when it is handed anything.
            spare=role == Role.TARGET and draw(st.integers(0, 3)) == 0,
            template=draw(st.sampled_from(templates)),
        )
        pods.setdefault(pod.name, pod)  # the API server keeps names unique
    previous = draw(
        st.one_of(
            st.none(),
            st.builds(
                lambda s: ModelDeploymentStatus(waiting_since=rfc3339(T0 - timedelta(seconds=s))),
                st.integers(0, 400),
            ),
            st.just(ModelDeploymentStatus(waiting_since="not a time")),
        )
    )
    siblings = draw(
        st.lists(
            st.builds(
                lambda i, n: sibling(i, pod=f"other-{n}", deployment="other"),
                st.sampled_from(identities),
                st.integers(0, 3),
            ),
            max_size=2,
        )
    )
    observed = observe(
        list(pods.values()),
        previous=previous,
        siblings=siblings,
        max_node_gpus=draw(st.sampled_from([None, 1, 8])),
    )
    return spec, observed


def _after(observed: Observed, result: Plan) -> list[ObservedPod]:
    return [p for p in observed.pods if not p.terminating and p.name not in result.delete]


@FAST
@given(worlds())
def test_plan_invariants_hold_for_any_observed_state(
    world: tuple[ModelDeploymentSpec, Observed],
) -> None:
    spec, observed = world
    result = plan(spec, observed)
    check_plan(observed, result, spec)
    identity = ident(spec)
    revision = Revision.of(spec)
    assert result.status.ready == f"{result.status.ready_replicas}/{spec.replicas}"
    assert [c.type for c in result.status.conditions] in (
        [],
        ["Scheduled", "WeightsLoaded", "InferenceReady", "Ready"],
    )
    assert all(c.last_transition_time for c in result.status.conditions)
    assert 0 <= int(result.status.loaded.rstrip("%")) <= 100
    # Pure: the same input gives the same plan.
    assert plan(spec, observed) == result

    if validate(spec, observed) is not None:
        assert not result.create and not result.delete and not result.relabel
        assert result.status.phase == Phase.FAILED
        return

    current = [p for p in observed.pods if not p.terminating and revision.current(p)]
    after = _after(observed, result)
    current_after = [p for p in after if revision.current(p)]
    # Every other pod is on its way out: deleted now, or kept Ready until enough current are.
    for pod in observed.pods:
        if not pod.terminating and not revision.current(pod) and not pod.inference_ready:
            assert result.delete.get(pod.name, "").startswith("superseded by a new"), pod.name

    # Transient failures of the current revision are always replaced; permanent ones are kept
    # unless scaled away.
    for pod in current:
        if pod.failed and not pod.permanent_failure:
            assert pod.name in result.delete
        if pod.permanent_failure and pod.name in result.delete:
            wanted = "warm spare no longer wanted" if pod.spare else "scaled down"
            assert result.delete[pod.name] == wanted

    # Ready replicas are retired only down to what is wanted.
    ready_before = sum(p.inference_ready for p in observed.pods if not p.terminating)
    ready_after = sum(p.inference_ready for p in after)
    assert ready_after >= min(spec.replicas, ready_before)

    # Never more replicas of the current revision than wanted, unless they already existed;
    # the same for spares. A woken spare counts as a replica from now on.
    def serving(pods: list[ObservedPod]) -> list[ObservedPod]:
        return [p for p in pods if not p.spare or p.name in result.unspare]

    spares_before = [p for p in current if p.spare]
    spares_after = [p for p in current_after if p.spare and p.name not in result.unspare]
    created = [d for d in result.create if not d.spare]
    new_spares = [d for d in result.create if d.spare]
    assert len(serving(current_after)) + len(created) <= max(spec.replicas, len(serving(current)))
    assert len(spares_after) + len(new_spares) <= max(spec.warm_spares, len(spares_before))
    # A scale-up is served by the spares first: no replica is created while one still waits.
    if created:
        assert not [p for p in spares_after if p.loading], "created a replica beside a spare"
    # Lowering warmSpares deletes spares only; old spares are never woken or handed anything.
    for name in result.unspare | set(result.handoff):
        pod = next(p for p in current_after if p.name == name)
        assert revision.current(pod)
    old_spares = [p for p in observed.pods if p.spare and not p.terminating and p not in current]
    assert all(p.name in result.delete for p in old_spares), "an old spare kept"

    # A loading target keeps at least one source, if it had one; a spare only while it pulls
    # from peers (one not handed anything yet is handed storage once no source is left).
    own_sources_before = [p for p in current if p.inference_ready and p.pod_ip]
    loading_targets = [
        p
        for p in current_after
        if p.loading
        and p.role == Role.TARGET
        and (not p.spare or (p.handoff is not None and bool(p.handoff.peers)))
    ]
    if own_sources_before and loading_targets:
        assert any(p.inference_ready and p.pod_ip for p in current_after)

    sources_exist = bool(result.status.sources) or any(
        s.model_identity == identity and s.deployment != NAME for s in observed.sibling_sources
    )
    for desired in new_spares:  # a spare waits for a scale-up to hand it peers
        assert desired.role == Role.TARGET and not desired.peers
    for desired in created:
        if spec.loading.strategy in ("Preload", "Direct"):
            assert desired.role == Role.SOURCE
        elif sources_exist:
            assert desired.role == Role.TARGET and desired.peers
        else:  # a storage source, or a target in standby until a source is Ready
            assert desired.role == Role.SOURCE or not desired.peers

    # Hand-offs go to loading targets: the Ready sources, or storage (then as a Source).
    for name, handoff in result.handoff.items():
        pod = next(p for p in current_after if p.name == name)
        assert pod.role == Role.TARGET and pod.loading
        if spec.loading.strategy in ("Preload", "Direct"):  # a spare left from Auto: storage
            assert handoff.storage and not handoff.peers
        else:
            assert bool(handoff.peers) == sources_exist
        assert handoff.storage == (result.relabel.get(name) == Role.SOURCE)
    storage_handoffs = {n for n, h in result.handoff.items() if h.storage}

    # Promotion: at most one, a Ready target of the current identity, only if no Source is left.
    promoted = {n: r for n, r in result.relabel.items() if n not in storage_handoffs}
    assert len(promoted) <= 1
    for name, role in promoted.items():
        pod = next(p for p in current if p.name == name)
        assert role == Role.SOURCE and pod.role == Role.TARGET and pod.inference_ready
        assert not any(p.role == Role.SOURCE and not p.failed for p in current_after)

    if result.status.phase == Phase.READY:
        assert sum(p.inference_ready for p in current_after) >= spec.replicas
        assert not created, "Ready while creating replicas (spares do not count)"
    if result.status.waiting_since is not None:
        assert spec.loading.strategy not in ("Preload", "Direct")
        assert not sources_exist
    assert result.requeue_after > 0


@SIM
@given(
    spec=specs(),
    new_replicas=st.integers(0, 6),
    new_spares=st.integers(0, 2),
    change_identity=st.booleans(),
    change_template=st.booleans(),
    change_at=st.integers(0, 12),
    picks=st.lists(st.integers(0, 5), min_size=60, max_size=60),
    failures=st.sets(st.integers(0, 59), max_size=3),
)
def test_random_sequences_keep_ready_replicas_and_converge(
    spec: ModelDeploymentSpec,
    new_replicas: int,
    new_spares: int,
    change_identity: bool,
    change_template: bool,
    change_at: int,
    picks: list[int],
    failures: set[int],
) -> None:
    cluster = Cluster(spec)
    cluster.reconcile()
    changes: dict[str, Any] = {"replicas": new_replicas}
    if spec.loading.strategy in ("Auto", "PeerToPeer"):
        changes["warmSpares"] = new_spares
    if change_identity:
        changes["model"] = {**spec.model.model_dump(by_alias=True), "revision": "v3"}
    if change_template:
        changes["template"] = {"env": [{"name": "ROLL", "value": "2"}]}
    changed = ModelDeploymentSpec.model_validate({**spec.model_dump(by_alias=True), **changes})
    for step, pick in enumerate(picks):
        if step == change_at:
            cluster.spec = changed
        todo = cluster.movable()
        live = sorted(p.name for p in [*cluster.live(), *cluster.spares()])
        if step in failures and live:
            # A transient failure (evicted, OOM): the reconcile must replace it.
            victim = live[pick % len(live)]
            cluster.update(victim, phase="Failed", failure="Evicted", pod_ready=False)
        elif todo:
            cluster.advance(todo[pick % len(todo)])
        else:
            cluster.now += timedelta(seconds=cluster.spec.loading.wait_for_source_seconds + 1)
        ready_before = cluster.ready_count()
        cluster.reconcile()
        # A reconcile never takes away ready replicas that are still wanted.
        assert cluster.ready_count() >= min(cluster.spec.replicas, ready_before)
        assert len(cluster.live()) <= max(
            cluster.spec.replicas + cluster.spec.rollout.max_surge, spec.replicas
        )
    final = cluster.settle()
    assert final.status.phase == Phase.READY
    assert cluster.ready_count() == changed.replicas == len(cluster.live())
    assert {p.identity for p in [*cluster.live(), *cluster.spares()]} <= {ident(changed)}
    made = {p.template for p in [*cluster.live(), *cluster.spares()]}
    assert made <= {pod_template_revision(changed)}, "a pod of an older template is left"
    # k spares, all warm, none Ready, none counted as replicas.
    assert len(cluster.spares()) == changed.warm_spares == final.status.spares
    assert all(p.in_standby and not p.inference_ready for p in cluster.spares())
    assert final.status.replicas == changed.replicas
    sources = [p for p in cluster.live() if p.role == Role.SOURCE]
    if changed.replicas and changed.loading.strategy not in ("Preload", "Direct"):
        assert sources, "a Ready deployment has a Source-role replica"
        expired = any(e.reason == "WaitForSourceExpired" for p in cluster.plans for e in p.events)
        if not expired and not failures and changed.loading.wait_for_source_seconds:
            # Without an expired wait only initialSources replicas ever load from storage.
            assert len(sources) <= changed.loading.initial_sources
