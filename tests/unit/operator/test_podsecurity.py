"""Which of a spec's fields need a namespace above PodSecurity `restricted` (podsecurity.py); the
real API server's refusals are tests/integration/test_pod_security_live.py's."""

from __future__ import annotations

from typing import Any

import pytest

from weightlift.api.model import ModelDeploymentSpec
from weightlift.operator.podsecurity import baseline_features, refusal_message


def spec(**wire: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate({"model": {"uri": "pvc://models/m"}, **wire})


@pytest.mark.parametrize(
    ("wire", "fields"),
    [
        ({}, []),
        ({"model": {"uri": "s3://bucket/m"}}, []),
        ({"model": {"uri": "hostpath:///models/m"}}, ["spec.model.uri"]),
        (
            {"model": {"uri": "s3://bucket/m"}, "loading": {"cache": {"enabled": True}}},
            ["spec.loading.cache.enabled"],
        ),
        ({"loading": {"cache": {"enabled": True}}}, []),  # a pvc:// model downloads nothing
        ({"template": {"rdmaResource": "rdma/ib"}}, ["spec.template.rdmaResource"]),
        ({"template": {"rdmaResources": ["rdma/rail1"]}}, ["spec.template.rdmaResources"]),
        (
            {"model": {"uri": "hostpath:///m"}, "template": {"rdmaResource": "rdma/ib"}},
            ["spec.model.uri", "spec.template.rdmaResource"],
        ),
    ],
)
def test_each_field_that_needs_baseline_is_named(wire: dict[str, Any], fields: list[str]) -> None:
    found = baseline_features(spec(**wire))
    assert [f.split(" ")[0] for f in found] == fields


def test_the_refusal_names_the_namespace_the_fields_and_keeps_the_api_servers_words() -> None:
    api = 'pods "x" is forbidden: violates PodSecurity "restricted:latest": ...'
    message = refusal_message(spec(template={"rdmaResource": "rdma/ib"}), "team-a", api)
    assert message.startswith("namespace team-a enforces")
    assert "IPC_LOCK" in message and message.endswith(api)
