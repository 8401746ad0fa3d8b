"""A pod template change rolls the replicas onto new pods, as a Deployment's pod-template-hash
does: new pods of the same model identity pull their weights from the old ones, old ones retire
as new ones pass their probes, and pods an older version made (no template label) are adopted
rather than rolled."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tests.support.planning import Cluster, check_plan, ident, make_spec, mkpod, observe
from weightlift.api.model import ModelDeploymentSpec, Phase, Role
from weightlift.operator.identity import pod_template_revision
from weightlift.operator.planning import ObservedPod, Plan, plan

OLD = make_spec(3)
NEW = make_spec(3, template={"env": [{"name": "ROLL", "value": "2"}]})
OLD_T, NEW_T = pod_template_revision(OLD), pod_template_revision(NEW)


def run(spec: ModelDeploymentSpec, pods: list[ObservedPod]) -> Plan:
    observed = observe(pods)
    result = plan(spec, observed)
    check_plan(observed, result, spec)
    return result


def pod(replica: int, template: str | None, role: Role = Role.TARGET, **kw: Any) -> ObservedPod:
    return replace(mkpod(OLD, replica, role, **kw), template=template)


def ready_old() -> list[ObservedPod]:
    return [pod(0, OLD_T, Role.SOURCE), pod(1, OLD_T), pod(2, OLD_T)]


def test_the_revision_is_what_a_pod_is_made_of_not_how_it_loads_or_scales() -> None:
    assert OLD_T != NEW_T and ident(OLD) == ident(NEW)
    same = [
        make_spec(5),
        make_spec(3, wait=10, initial_sources=2),
        make_spec(3, probe={"request": {"inputs": [{"name": "y"}]}}),
        make_spec(3, template={}),  # a default written out is the default
    ]
    assert {pod_template_revision(s) for s in same} == {OLD_T}
    other = [
        make_spec(3, template={"image": "registry.local/worker:2"}),
        make_spec(3, template={"resources": {"limits": {"memory": "8Gi"}}}),
        make_spec(3, runtime={"port": 9000}),
        make_spec(3, initHooks={"library": "libinit.so"}),
    ]
    assert len({OLD_T, *map(pod_template_revision, other)}) == 1 + len(other)


def test_a_template_change_adds_a_surge_pod_that_pulls_from_the_old_replicas() -> None:
    old = ready_old()
    result = run(NEW, old)
    assert result.delete == {}
    ((created,),) = [result.create]
    assert created.role == Role.TARGET
    assert [p.pod for p in created.peers] == [p.name for p in old]
    assert created.name not in {p.name for p in old}
    assert result.status.model_identity == ident(OLD)
    assert result.status.updated_replicas == 0 and result.status.ready == "3/3"
    assert result.status.phase != Phase.READY
    assert result.adopt == {}


def test_an_old_replica_retires_per_new_one_ready_and_the_next_pulls_from_both() -> None:
    old = ready_old()
    new = replace(mkpod(OLD, 3, Role.TARGET), template=NEW_T)
    result = run(NEW, [*old, new])
    assert result.delete == {old[2].name: "rolled over to the new pod template"}
    ((created,),) = [result.create]
    assert [p.pod for p in created.peers] == [old[0].name, old[1].name, new.name]
    assert result.status.updated_replicas == 1


def test_an_old_replica_not_ready_goes_at_once() -> None:
    old = [pod(0, OLD_T, Role.SOURCE), pod(1, OLD_T, state="loading")]
    result = run(make_spec(2, template=NEW.template.wire()), old)
    assert result.delete == {old[1].name: "superseded by a new pod template"}
    assert [p.pod for p in result.create[0].peers] == [old[0].name]


def test_pods_an_older_version_made_are_adopted_not_rolled() -> None:
    old = [pod(0, None, Role.SOURCE), pod(1, None), pod(2, OLD_T)]
    result = run(OLD, old)
    assert result.adopt == {old[0].name: OLD_T, old[1].name: OLD_T}
    assert result.create == [] and result.delete == {}
    assert result.status.phase == Phase.READY and result.status.updated_replicas == 3


def test_a_rollout_keeps_every_replica_ready_and_loads_nothing_from_storage() -> None:
    cluster = Cluster(OLD)
    cluster.settle()
    first = len(cluster.plans)
    cluster.spec = NEW
    dips: list[int] = []

    def watch(c: Cluster) -> None:
        if c.ready_count() < OLD.replicas:
            dips.append(c.ready_count())

    result = cluster.settle(on_step=watch)
    assert result.status.phase == Phase.READY and not dips, dips
    live = cluster.live()
    assert len(live) == 3 and {p.template for p in live} == {NEW_T}
    # Every pod made since (an old one's name too, once it is gone) pulled from a peer.
    created = [d for p in cluster.plans[first:] for d in p.create]
    assert len(created) == 3
    assert created and all(d.role == Role.TARGET and d.peers for d in created), created
