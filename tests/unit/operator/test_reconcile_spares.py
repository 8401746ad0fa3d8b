"""Warm spares in a reconcile pass: the spare label reaches planning through the pod index, a
woken spare loses it in the same patch that hands it peers or storage, and a pass that still
sees the label (kopf's index trails our own patches) does not take the woken pod for a spare
again and wake one more."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from tests.support.planning import RecordedApi, no_sources
from weightlift.api.labels import (
    IDENTITY_LABEL,
    PEERS_ANNOTATION,
    REPLICA_LABEL,
    ROLE_LABEL,
    SERVING_LABEL,
    SPARE_LABEL,
    TEMPLATE_LABEL,
    WOKEN_ANNOTATION,
)
from weightlift.api.times import parse_rfc3339
from weightlift.api.worker import ASSIGNMENT_ENV, Assignment, PeerHandoff
from weightlift.operator import reconcile
from weightlift.operator.identity import model_identity, pod_template_revision
from weightlift.operator.planning import Plan, pod_name
from weightlift.operator.state import OperatorState

UID = "3c1f7c3e-0000-4000-8000-0000000000aa"
SPEC: dict[str, Any] = {"model": {"uri": "pvc://models/llama"}, "replicas": 1, "warmSpares": 1}
IDENTITY = model_identity(reconcile.parse_spec(SPEC))  # type: ignore[arg-type]
TEMPLATE = pod_template_revision(reconcile.parse_spec(SPEC))  # type: ignore[arg-type]
LOG = logging.getLogger("test")


def _state() -> OperatorState:
    return OperatorState(core=cast(Any, None), custom=cast(Any, None), http=cast(Any, None))


def _body(replicas: int) -> dict[str, Any]:
    meta = {"name": "llama", "namespace": "ns", "uid": UID, "generation": 2}
    return {"metadata": meta, "spec": {**SPEC, "replicas": replicas}}


def _spare_pod(replica: int, spare: bool = True) -> dict[str, Any]:
    """A spare as the pod index holds it: scheduled, not Ready, nothing handed."""
    labels = {
        REPLICA_LABEL: str(replica),
        IDENTITY_LABEL: IDENTITY,
        TEMPLATE_LABEL: TEMPLATE,
        ROLE_LABEL: "Target",
    }
    if spare:
        labels[SPARE_LABEL] = "true"
    return {
        "metadata": {
            "name": pod_name("llama", IDENTITY, replica),
            "uid": f"uid-{replica}",
            "labels": labels,
            "annotations": {PEERS_ANNOTATION: ""},
        },
        "spec": {"nodeName": "gpu-0"},
        "status": {"phase": "Pending"},
    }


def test_the_pod_index_keeps_the_spare_label() -> None:
    slim = reconcile.pod_essentials(_spare_pod(1))
    assert slim["metadata"]["labels"][SPARE_LABEL] == "true"


async def test_a_woken_spare_loses_its_label_in_the_patch_that_hands_it_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = RecordedApi(monkeypatch)
    result = Plan(
        unspare={"p-1"},
        handoff={"p-1": PeerHandoff(storage=True)},
        relabel={"p-1": reconcile.Role.SOURCE},
    )
    before = datetime.now(UTC).replace(microsecond=0)
    await reconcile._patch_pods(_state(), "ns", result, LOG)
    ((name, metadata),) = api.patches
    assert name == "p-1"
    assert metadata["labels"] == {ROLE_LABEL: "Source", SPARE_LABEL: None}
    woken_at = metadata["annotations"].pop(WOKEN_ANNOTATION)
    assert metadata["annotations"] == {PEERS_ANNOTATION: '{"storage":true}'}
    assert before <= parse_rfc3339(woken_at) <= datetime.now(UTC)


async def test_scale_up_from_zero_wakes_the_spare_once_then_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = RecordedApi(monkeypatch)
    state = _state()
    spare = _spare_pod(0)
    await reconcile.reconcile(state, _body(1), [spare], no_sources, LOG)
    name = spare["metadata"]["name"]
    ((patched, woken),) = api.patches
    assert patched == name
    # Woken and handed storage in one patch, which also puts it in its Service.
    assert woken["labels"] == {ROLE_LABEL: "Source", SPARE_LABEL: None, SERVING_LABEL: "true"}
    assert woken["annotations"][PEERS_ANNOTATION] == '{"storage":true}'
    assert WOKEN_ANNOTATION in woken["annotations"]
    (created,) = api.created
    assert created["metadata"]["labels"][SPARE_LABEL] == "true"
    assert SERVING_LABEL not in created["metadata"]["labels"]  # a spare serves nobody
    env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
    assignment = Assignment.model_validate_json(env[ASSIGNMENT_ENV])
    assert assignment.spare is True and assignment.peers == []
    assert created["metadata"]["annotations"][PEERS_ANNOTATION] == ""
    # The next pass: the index shows the new spare but not yet our patch of the old one.
    new = _spare_pod(1)
    api.patches.clear()
    api.created.clear()
    await reconcile.reconcile(state, _body(1), [spare, new], no_sources, LOG)
    assert not any(SPARE_LABEL in m.get("labels", {}) for _, m in api.patches), api.patches
    assert api.created == []
    # Once the index caught up, the guard forgets the pod.
    handed = _spare_pod(0, spare=False)
    await reconcile.reconcile(state, _body(1), [handed, new], no_sources, LOG)
    assert state.deployment(UID).woken == {}


def test_a_woken_spare_is_forgotten_when_its_label_is_gone_or_the_wait_ran_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightlift.operator import state as operator_state

    state = _state()
    state.woke_spares(UID, {"a", "b"})
    assert state.still_spare_labelled(UID, {"a", "b", "c"}) == {"a", "b"}
    assert state.still_spare_labelled(UID, {"a"}) == {"a"}
    monkeypatch.setattr(operator_state, "CREATED_POD_WAIT_SECONDS", -1.0)
    state.woke_spares(UID, {"a"})
    assert state.still_spare_labelled(UID, {"a"}) == set()
    assert state.still_spare_labelled("other", {"a"}) == set()


async def test_a_hand_off_the_index_does_not_show_yet_is_sent_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf's index trails our patches: a pass planning against it hands the pod peers again.
    That patch is not sent twice; storage instead of peers is, and once the index shows the
    last patch, a new one is sent."""
    api = RecordedApi(monkeypatch)
    state = _state()
    peers = PeerHandoff.parse('{"peers":[{"pod":"p-0","address":"127.0.0.1:1"}]}')
    assert peers is not None
    result = Plan(handoff={"p-1": peers})
    uids = {"p-1": "uid-1"}
    await reconcile._patch_pods(state, "ns", result, LOG, uids)
    await reconcile._patch_pods(state, "ns", result, LOG, uids)  # the index lags
    # Planned against the lagging index with one more source: it has its peers already.
    more = PeerHandoff.parse(
        '{"peers":[{"pod":"p-0","address":"127.0.0.1:1"},{"pod":"p-2","address":"127.0.0.1:2"}]}'
    )
    assert more is not None
    await reconcile._patch_pods(state, "ns", Plan(handoff={"p-1": more}), LOG, uids)
    assert [name for name, _ in api.patches] == ["p-1"]
    # Another pod, or the same pod handed something else, is sent at once.
    await reconcile._patch_pods(state, "ns", Plan(handoff={"p-2": peers}), LOG, {"p-2": "uid-2"})
    await reconcile._patch_pods(
        state, "ns", Plan(handoff={"p-1": PeerHandoff(storage=True)}), LOG, uids
    )
    assert [name for name, _ in api.patches] == ["p-1", "p-2", "p-1"]
    # The index shows the storage hand-off: the memory goes, and a later plan is sent again.
    shown = {"labels": {}, "annotations": {PEERS_ANNOTATION: '{"storage":true}'}}
    state.index_shows("uid-1", shown)
    assert state.pod("uid-1").sent is None
    await reconcile._patch_pods(
        state, "ns", Plan(handoff={"p-1": PeerHandoff(storage=True)}), LOG, uids
    )
    assert len(api.patches) == 4


async def test_a_pod_an_older_version_made_is_labelled_with_the_current_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adopted, not rolled (planning.Revision): one patch gives it the label the pod index
    keeps, and the next pass, seeing it, patches nothing."""
    api = RecordedApi(monkeypatch)
    state = _state()
    old = _spare_pod(0, spare=False)
    del old["metadata"]["labels"][TEMPLATE_LABEL]
    await reconcile.reconcile(state, _body(1), [old], no_sources, LOG)
    adopted = [m for name, m in api.patches if name == old["metadata"]["name"]]
    assert [m["labels"] for m in adopted] == [{TEMPLATE_LABEL: TEMPLATE}], api.patches
    labelled = _spare_pod(0, spare=False)
    assert reconcile.pod_essentials(labelled)["metadata"]["labels"][TEMPLATE_LABEL] == TEMPLATE
    api.patches.clear()
    await reconcile.reconcile(state, _body(1), [labelled], no_sources, LOG)
    assert not [m for name, m in api.patches if name == old["metadata"]["name"]], api.patches
