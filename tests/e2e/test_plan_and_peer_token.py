"""The worker plan out of the environment and the P2P token, end to end on the real control plane:
a spec whose plan no environment variable can carry reaches Ready over P2P (with tokens); the
P2P routes refuse requests without the token; status and logs never show it; a plan ConfigMap
that is not the operator's is refused by the worker, which never serves."""

from __future__ import annotations

import base64
import errno
import hashlib
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.e2e import READY_TIMEOUT, pids_of, wait_gone
from weightlift.api.model import ModelDeploymentSpec
from weightlift.local.kube import call, delete
from weightlift.local.observe import Observer
from weightlift.local.stack import LocalStack, model_deployment
from weightlift.operator.identity import model_identity
from weightlift.operator.pods import plan_for

JSON = dict[str, Any]
Deploy = Callable[..., Observer]
# Linux refuses one environment string longer than this (MAX_ARG_STRLEN, 32 pages): E2BIG.
MAX_ARG_STRLEN = 32 * 4096
# As many engine arguments as the CRD admits, each as long as it admits (a builtin runtime
# ignores them; they are in the plan every replica reads).
BIG_ARGS = [f"--weightlift-padding-{i:03d}=" + "x" * 998 for i in range(128)]


def _configmaps(stack: LocalStack, name: str) -> list[JSON]:
    listing = call(
        stack.kube.core.list_namespaced_config_map,
        stack.namespace,
        label_selector=f"weightlift.dev/deployment={name},weightlift.dev/plan",
    )
    items: list[JSON] = listing["items"]
    return items


def _worker_logs(stack: LocalStack, name: str) -> str:
    root = stack.process_node.config.state_dir / "pods"
    logs = sorted(root.glob(f"{stack.namespace}_{name}-*/worker.log"))
    assert logs, f"no worker logs of {name} under {root}"
    return "\n".join(p.read_text(errors="replace") for p in logs)


def test_a_plan_too_big_for_any_env_reaches_ready_over_p2p_with_tokens(
    stack: LocalStack, demo_model: tuple[Path, JSON]
) -> None:
    model_dir, probe = demo_model
    manifest = model_deployment("bigplan", model_dir, probe=probe, replicas=2)
    manifest["spec"]["runtime"] = {"engineArgs": BIG_ARGS}
    obs = Observer(stack, "bigplan")
    stack.apply(manifest)
    try:
        _check_big_plan(stack, obs)
    finally:
        pids = pids_of(stack, "bigplan")
        if stack.get_md("bigplan") is not None:
            stack.delete_md("bigplan")
        wait_gone(stack, "bigplan", pids)


def _check_big_plan(stack: LocalStack, obs: Observer) -> None:
    obs.wait_ready(READY_TIMEOUT * 2)

    rows = obs.replica_statuses()
    assert len(rows) == 2 and all(r["ready"] for r in rows)
    (plan,) = _configmaps(stack, "bigplan")
    text = plan["data"]["plan.json"]
    assert "--weightlift-padding-127=" in text and len(text) > MAX_ARG_STRLEN
    # The old way, the plan as one environment variable, cannot even start a process.
    with pytest.raises(OSError) as too_big:
        subprocess.run(["true"], env={"WEIGHTLIFT_PLAN": text}, check=False)
    assert too_big.value.errno == errno.E2BIG
    pods = stack.pods("bigplan")
    digest = hashlib.sha256(text.encode()).hexdigest()
    for pod in pods:
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["WEIGHTLIFT_PLAN_SHA256"]["value"] == digest
        assert sum(len(str(e)) for e in env.values()) < 4096
    # The second replica pulled its weights from the first: the token let it in.
    assert any(str(r["loadedFrom"]).startswith("peer:") for r in rows), rows

    identity = obs.status()["modelIdentity"]
    secret = call(
        stack.kube.core.read_namespaced_secret, f"weightlift-peer-{identity}", stack.namespace
    )
    token = base64.b64decode(secret["data"]["token"]).decode()
    source = next(r for r in obs.summary()["replicas"] if r["role"] == "Source")
    manifest_url = f"{source['endpoint']}/weightlift/v1/p2p/manifest"
    params = {"rank": "0", "identity": identity}
    assert httpx.get(manifest_url, params=params).status_code == 401
    wrong = {"Authorization": "Bearer " + "w" * len(token)}
    assert httpx.get(manifest_url, params=params, headers=wrong).status_code == 403
    ok = httpx.get(manifest_url, params=params, headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200 and ok.json()["agent_metadata"]

    # No secret in what the worker shows or writes.
    for r in obs.summary()["replicas"]:
        status = httpx.get(f"{r['endpoint']}/weightlift/v1/status").text
        assert token not in status and '"phase":"Serving"' in status.replace(" ", "")
    assert token not in _worker_logs(stack, "bigplan")
    assert token not in text

    # A new revision: a new plan; the old one is swept once its pods are gone.
    old = plan["metadata"]["name"]
    stack.patch_md("bigplan", {"spec": {"model": {"revision": "2"}}})

    def swept(o: Observer) -> bool:
        names = [c["metadata"]["name"] for c in _configmaps(stack, "bigplan")]
        return o.phase() == "Ready" and len(names) == 1 and names[0] != old

    obs.wait(swept, READY_TIMEOUT * 2, "rollover with the old plan ConfigMap swept", interval=1)


def test_a_plan_configmap_that_is_not_the_operators_is_refused(
    stack: LocalStack, deployments: Deploy, demo_model: tuple[Path, JSON]
) -> None:
    """Someone who may write ConfigMaps put the plan's name there first, with another init
    library: the pods mount it, the worker checks it against the digest in its env, refuses."""
    model_dir, probe = demo_model
    obs = deployments("tamper", model_dir, probe, replicas=0)
    # The plan the operator will want, from the spec as the API server stored it (defaults in).
    stored = stack.get_md("tamper")
    assert stored is not None
    spec = ModelDeploymentSpec.model_validate(stored["spec"])
    plan = plan_for("tamper", stack.namespace, spec, model_identity(spec))
    tampered = plan.text.replace("hooks/libinit.so", "/tmp/evil/libinit.so")
    assert tampered != plan.text
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": plan.name, "namespace": stack.namespace},
        "data": {"plan.json": tampered},
    }
    core = stack.kube.core
    call(core.create_namespaced_config_map, stack.namespace, cm)
    try:
        stack.scale_md("tamper", 1)

        def refused(o: Observer) -> bool:
            return o.phase() == "Failed"

        obs.wait(refused, READY_TIMEOUT, "the worker to refuse the plan")
        (pod,) = stack.pods("tamper")
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["WEIGHTLIFT_PLAN_CONFIGMAP"] == plan.name  # the operator's name, our content
        message = obs.status().get("message", "")
        assert f"ConfigMap {plan.name}" in message and "sha256" in message, message
        assert plan.digest in message, message
        assert int(obs.status().get("readyReplicas", 0)) == 0
        assert not any(r.get("ready") for r in obs.replica_statuses())
        assert "refusing to run it" in _worker_logs(stack, "tamper")
    finally:
        delete(core.delete_namespaced_config_map, plan.name, stack.namespace)
