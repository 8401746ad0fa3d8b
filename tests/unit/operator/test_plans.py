"""The plan ConfigMap and the peer token Secret the operator puts beside worker pods."""

from __future__ import annotations

import json

from tests.unit.operator.test_pods import (
    NAME,
    NAMESPACE,
    UID,
    container,
    desired,
    env_of,
    make_spec,
    render,
)
from weightlift.api.labels import PLAN_LABEL
from weightlift.api.model import Role
from weightlift.api.worker import ASSIGNMENT_ENV, PEER_TOKEN_ENV, PLAN_SHA256_ENV, plan_digest
from weightlift.operator.identity import model_identity
from weightlift.operator.pods import plan_for
from weightlift.operator.shared_objects import (
    configmap_manifest,
    sweep_selector,
    token_secret_manifest,
    token_secret_name,
)

BIG_PROBE = {
    "request": {
        "inputs": [{"name": "x", "shape": [1, 1024], "datatype": "FP32", "data": [0.5] * 1024}]
    },
    "tolerance": 1e-3,
    "expectedOutputs": [{"name": f"out{i}", "data": [0.123456789] * 1024} for i in range(8)],
}


def test_every_replica_of_a_revision_shares_one_plan_and_a_new_revision_gets_another() -> None:
    spec = make_spec()
    a, b = render(spec, desired(spec, 0)), render(spec, desired(spec, 1, Role.TARGET))
    assert env_of(a)[PLAN_SHA256_ENV] == env_of(b)[PLAN_SHA256_ENV]
    assert a["metadata"]["labels"][PLAN_LABEL] == b["metadata"]["labels"][PLAN_LABEL]
    assert env_of(a)[ASSIGNMENT_ENV] != env_of(b)[ASSIGNMENT_ENV]
    other = make_spec(loading={"loadTimeoutSeconds": 77})
    one, two = plan_for(NAME, NAMESPACE, spec, "i"), plan_for(NAME, NAMESPACE, other, "i")
    assert one.name != two.name and one.digest != two.digest
    assert one.name.startswith(f"{NAME}-plan-") and plan_digest(one.text) == one.digest


def test_a_large_probe_lives_in_the_configmap_not_in_the_env() -> None:
    spec = make_spec(probe=BIG_PROBE)
    pod = render(spec)
    env_bytes = sum(len(json.dumps(e)) for e in container(pod)["env"])
    plan = plan_for(NAME, NAMESPACE, spec, model_identity(spec))
    assert len(plan.text) > 80_000 and env_bytes < 2_000


def test_the_configmap_is_immutable_owned_and_labelled() -> None:
    plan = plan_for(NAME, NAMESPACE, make_spec(), "ident")
    cm = configmap_manifest(plan, NAMESPACE, NAME, UID)
    assert cm["immutable"] is True
    assert cm["data"] == {"plan.json": plan.text}
    assert cm["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "weightlift.dev/v1alpha1",
            "kind": "ModelDeployment",
            "name": NAME,
            "uid": UID,
        }
    ]
    assert cm["metadata"]["labels"][PLAN_LABEL] == plan.label
    assert cm["metadata"]["annotations"]["weightlift.dev/plan-sha256"] == plan.digest


def test_the_sweep_selects_only_this_deployments_other_plans() -> None:
    assert sweep_selector("llama", {"abc"}) == (
        "weightlift.dev/deployment=llama,weightlift.dev/plan,weightlift.dev/plan notin (abc)"
    )


def test_the_token_secret_is_per_identity_random_and_owned() -> None:
    one = token_secret_manifest("ident", NAMESPACE, NAME, UID)
    two = token_secret_manifest("ident", NAMESPACE, "sibling", "uid-2")
    assert one["metadata"]["name"] == two["metadata"]["name"] == token_secret_name("ident")
    assert len(one["stringData"]["token"]) >= 40
    assert one["stringData"]["token"] != two["stringData"]["token"]  # the first create wins
    assert one["metadata"]["ownerReferences"][0]["uid"] == UID


def test_an_external_runtime_gets_no_peer_token() -> None:
    spec = make_spec(runtime={"type": "External", "command": ["tritonserver"], "port": 8001})
    assert PEER_TOKEN_ENV not in env_of(render(spec))
    assert PEER_TOKEN_ENV in env_of(render(make_spec()))
