"""The spec generator of `weightlift bench fuzz`: built from the CRD schema, mutations land where
they say, and a refusal counts as naming the field only when it does."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings

from weightlift.api.model import ModelDeploymentSpec
from weightlift.bench.fuzz_specs import (
    FUZZ_SELECTOR,
    Mutation,
    base_spec,
    leaves,
    mutable_fields,
    names_a_field,
    spec_schema,
    specs,
)


def test_fields_come_from_the_crd_schema() -> None:
    paths = {f.path for f in leaves(spec_schema())}
    assert ("model", "uri") in paths
    assert ("template", "env", "[]", "name") in paths
    assert ("loading", "preload", "threads") in paths
    # The pod template's upstream types (api/kubeschema.py), sidecars' probes included.
    assert ("template", "spec", "affinity", "nodeAffinity") in paths
    assert ("template", "spec", "containers", "[]", "readinessProbe", "httpGet", "port") in paths
    assert ("template", "metadata", "annotations") in paths
    fuzzed = {f.path for f in mutable_fields(spec_schema())}
    assert not any(p[:2] == ("template", "nodeSelector") for p in fuzzed)


def test_the_base_spec_is_valid() -> None:
    ModelDeploymentSpec.model_validate(base_spec("/m"))


@settings(max_examples=200, deadline=None, database=None)
@given(drawn=specs(mutable_fields(spec_schema()), "/m"))
def test_generated_specs_keep_off_every_node(drawn: tuple[dict[str, Any], list[Mutation]]) -> None:
    """A template the schema admits always carries the selector no node matches."""
    spec, _ = drawn
    if isinstance(spec.get("template"), dict):
        assert spec["template"]["nodeSelector"] == FUZZ_SELECTOR


def test_names_a_field() -> None:
    muts = [Mutation(("template", "env", "[]", "name"), "LD_PRELOAD", False)]
    assert names_a_field('spec.template.env[0].name: Invalid value: "LD_PRELOAD"', muts)
    assert names_a_field("name: reserved for the worker", muts)
    assert not names_a_field("Internal error occurred", muts)


def test_mutations_stack_on_earlier_ones() -> None:
    """A later mutation below a field an earlier one turned into a scalar or a list of scalars
    (the case that once crashed the generator)."""
    from weightlift.bench.fuzz_specs import _set

    spec: dict[str, Any] = {"template": {"env": [None]}}
    _set(spec, ("template", "env", "[]", "name"), "A", False)
    assert spec["template"]["env"] == [{"name": "A"}]
    spec = {"template": 7}
    _set(spec, ("template", "env", "[]", "name"), "A", False)
    assert spec == {"template": {"env": [{"name": "A"}]}}
    spec = {"probe": {"request": "x"}}
    _set(spec, ("probe", "request", "inputs", "[]", "shape", "[]"), 1, False)
    assert spec["probe"]["request"] == {"inputs": [{"shape": [None]}]}


def test_owned_template_mutations_are_refused_by_pydantic_too() -> None:
    """Each of the fuzzer's operator-owned template values is refused (what the API server's
    CEL rules refuse, their pydantic mirror refuses too)."""
    import pytest
    from pydantic import ValidationError

    from weightlift.bench.fuzz_specs import OWNED_TEMPLATE, _set

    for path, value in OWNED_TEMPLATE:
        spec = base_spec("/m")
        _set(spec, path, value, False)
        with pytest.raises(ValidationError, match=r"spec\.template\."):
            ModelDeploymentSpec.model_validate(spec)
