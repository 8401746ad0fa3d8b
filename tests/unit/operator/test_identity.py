"""Model identity: stable, sensitive to what determines the bytes per rank, blind to the rest."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest

from weightlift.api.model import ModelDeploymentSpec
from weightlift.operator.identity import IDENTITY_LENGTH, model_identity

BASE: dict[str, Any] = {
    "model": {"uri": "pvc://models/llama-3", "revision": "main", "format": "pt2", "dtype": "auto"},
    "replicas": 2,
    "parallelism": {"tensor": 2},
}


def spec(**changes: dict[str, Any] | int) -> ModelDeploymentSpec:
    body: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return ModelDeploymentSpec.model_validate(body)


def test_identity_is_a_stable_hex_digest() -> None:
    first = model_identity(spec())
    assert first == model_identity(spec())
    assert first == model_identity(ModelDeploymentSpec.model_validate(BASE))
    # 16 lowercase hex digits: a valid label value, as pods and status carry it
    assert len(first) == IDENTITY_LENGTH == 16
    assert re.fullmatch(r"[0-9a-f]{16}", first), first
    # The golden value (sha256 of the pinned material below, its first 16 hex digits).
    assert first == "7a273c4ee653c758"
    assert model_identity(spec(model={"uri": "pvc://models/llama-4"})) != first


def test_identity_value_is_pinned() -> None:
    """The hash material is a contract between operator versions; changing it rolls fleets."""
    material = {
        "uri": "pvc://models/llama-3",
        "revision": "main",
        "format": "pt2",
        "dtype": "auto",
        "tensor": 2,
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    assert model_identity(spec()) == digest[:16]


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"uri": "pvc://models/llama-4"}},
        {"model": {"uri": "hostpath:///models/llama-3"}},
        {"model": {"revision": "v2"}},
        {"model": {"format": "safetensors"}, "runtime": {"type": "External", "command": ["x"]}},
        {"model": {"dtype": "bfloat16"}},
        {"parallelism": {"tensor": 4}},
        {"parallelism": {"pipeline": 2}},
        {"parallelism": {"podsPerReplica": 2}},
        {"parallelism": {"pipeline": 2, "podsPerReplica": 4}},
    ],
)
def test_identity_changes_with_each_identity_field(changes: dict[str, Any]) -> None:
    assert model_identity(spec(**changes)) != model_identity(spec())


@pytest.mark.parametrize(
    "changes",
    [
        {"replicas": 7},
        {"probe": {"request": {"inputs": []}, "periodSeconds": 99}},
        {"loading": {"strategy": "Direct", "initialSources": 3}},
        {"template": {"image": "example.com/other:1"}},
        {"rollout": {"maxSurge": 4}},
        {"model": {"name": "served-name"}},
        {"runtime": {"port": 9000}},
        {"initHooks": {"library": "libinit.so"}},
    ],
)
def test_identity_ignores_everything_else(changes: dict[str, Any]) -> None:
    assert model_identity(spec(**changes)) == model_identity(spec())


def test_single_pod_single_stage_identities_are_unchanged() -> None:
    """pipeline and podsPerReplica at their defaults (1), said or not, keep the identity every
    existing deployment has (no rollover on upgrade); other values join the pinned material."""
    explicit = spec(parallelism={"tensor": 2, "pipeline": 1, "podsPerReplica": 1})
    assert model_identity(explicit) == model_identity(spec())
    material = {
        "uri": "pvc://models/llama-3",
        "revision": "main",
        "format": "pt2",
        "dtype": "auto",
        "tensor": 2,
        "pipeline": 2,
        "podsPerReplica": 2,
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    assert model_identity(spec(parallelism={"pipeline": 2, "podsPerReplica": 2})) == digest[:16]


def test_same_rank_count_laid_out_differently_is_another_identity() -> None:
    """4 ranks as TP4, TP2 x PP2, or TP4 over 2 pods: each rank holds or sits on other bytes."""
    layouts = [
        {"tensor": 4},
        {"tensor": 2, "pipeline": 2},
        {"tensor": 4, "podsPerReplica": 2},
        {"tensor": 2, "pipeline": 2, "podsPerReplica": 2},
        {"tensor": 4, "podsPerReplica": 4},
    ]
    assert len({model_identity(spec(parallelism=p)) for p in layouts}) == len(layouts)


def test_vllm_replicas_meet_only_when_started_alike() -> None:
    llm = {"model": {"format": "safetensors"}}
    vllm = spec(**llm, runtime={"engine": "vLLM", "engineArgs": ["--enforce-eager"]})
    external = spec(**llm, runtime={"type": "External", "command": ["x"]})
    assert model_identity(vllm) != model_identity(external)  # vLLM's tensors, not the files'
    assert model_identity(external) == model_identity(
        spec(model={"format": "safetensors"}, runtime={"type": "External", "command": ["y"]})
    )
    same = spec(**llm, runtime={"engine": "vLLM", "engineArgs": ["--enforce-eager"], "port": 9000})
    assert model_identity(same) == model_identity(vllm)
    other = spec(**llm, runtime={"engine": "vLLM", "engineArgs": ["--dtype", "float16"]})
    assert model_identity(other) != model_identity(vllm)


def test_trailing_slash_in_uri_is_the_same_model() -> None:
    assert model_identity(spec(model={"uri": "pvc://models/llama-3/"})) == model_identity(spec())


def test_identities_of_many_revisions_do_not_collide() -> None:
    seen = {model_identity(spec(model={"revision": f"r{i}"})) for i in range(500)}
    assert len(seen) == 500
