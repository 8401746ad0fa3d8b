"""The pydantic model refuses what the CRD refuses (for specs that never passed admission), and
the shared patterns accept the Kubernetes values they are meant for."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from weightlift.api import limits
from weightlift.api.model import ModelDeploymentSpec


def spec(**fields: Any) -> dict[str, Any]:
    return {"model": {"uri": "pvc://models/tiny"}, **fields}


def refused(raw: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        ModelDeploymentSpec.model_validate(raw)
    return str(info.value)


@pytest.mark.parametrize("name", ["WEIGHTLIFT_PLAN", "WEIGHTLIFT_BIND_HOST", "LD_PRELOAD"])
def test_reserved_env_names_refused(name: str) -> None:
    message = refused(spec(template={"env": [{"name": name, "value": "x"}]}))
    assert "reserved for the worker" in message


def test_env_value_with_nul_refused() -> None:
    assert "env.0.value" in refused(spec(template={"env": [{"name": "A", "value": "a\0b"}]}))


def test_probe_request_depth_and_size_bounded() -> None:
    deep: Any = 1
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        deep = [deep]
    message = refused(spec(probe={"request": {"inputs": [{"data": deep}]}}))
    assert "nested deeper than" in message
    big = {"inputs": [{"data": ["x" * 1000] * 1000}]}
    assert "bytes of JSON" in refused(spec(probe={"request": big}))


def test_json_depth_counts_levels() -> None:
    assert limits.json_depth(1, 8) == 0
    assert limits.json_depth({"a": [1, {"b": []}]}, 8) == 4
    assert limits.json_depth([[[[[[]]]]]], 3) == 4  # stops just past the limit


@pytest.mark.parametrize(
    ("pattern", "good", "bad"),
    [
        (
            limits.QUALIFIED_NAME,
            ["gpu", "nvidia.com/gpu", "kubernetes.io/hostname", "a_b.c-d"],
            ["", "bad key!", "/gpu", "Nvidia.com/gpu", "a" * 64, "-a"],
        ),
        (limits.LABEL_VALUE, ["", "v1", "a.b_c-d"], ["not a value", "-a", "a" * 64]),
        (limits.QUANTITY, ["1", "500m", "8Gi", "0.5", "1e9", "+2"], ["lots", "1 Gi", "Gi", ""]),
        (
            limits.IMAGE,
            [
                "busybox",
                "ghcr.io/weightlift/worker:0.1.0",
                "localhost:5000/a/b:c",
                "repo/x@sha256:" + "a" * 64,
            ],
            ["busybox; rm -rf /", "worker:$(id)", "Busybox", "a b", ""],
        ),
        (limits.DNS_SUBDOMAIN, ["default", "weightlift-worker", "a.b"], ["Bad Name!!", "-a", ""]),
    ],
)
def test_patterns(pattern: str, good: list[str], bad: list[str]) -> None:
    for value in good:
        assert re.fullmatch(pattern, value), value
    for value in bad:
        assert not re.fullmatch(pattern, value), value


@pytest.mark.parametrize(
    ("template", "where"),
    [
        ({"nodeSelector": {"bad key!": "x"}}, "nodeSelector"),
        ({"resources": {"requests": {"cpu": "lots"}}}, "requests.cpu"),
        ({"serviceAccountName": "Bad Name!!"}, "serviceAccountName"),
        ({"image": "busybox; rm -rf /"}, "image"),
        ({"env": [{"name": f"V{i}"} for i in range(limits.ENV_ITEMS + 1)]}, "env"),
    ],
)
def test_template_fields_checked(template: dict[str, Any], where: str) -> None:
    assert where in refused(spec(template=template))
