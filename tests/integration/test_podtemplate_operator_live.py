"""The real operator renders spec.template's pod-template parts into the worker pods it creates
on the real control plane (kwok nodes: the pods are created and scheduled, never run), and a
clash only the render can see is named in the status. ~20 s with the operator up."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.test_operator_live import Env, env  # noqa: F401 (the fixture)
from tests.support.cluster import wait_for
from tests.support.podtemplates import FULL, FULL_CLASSES


def test_worker_pods_carry_the_whole_template(env: Env) -> None:  # noqa: F811
    for obj in FULL_CLASSES:
        env.kubectl("apply", "-f", "-", input=json.dumps(obj))
    env.create("templated", template=FULL)
    try:
        [pod] = env.wait_pods("templated", 1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {json.dumps(env.status('templated'))}") from None
    raw: dict[str, Any] = env.core.api_client.sanitize_for_serialization(pod)
    meta, spec = raw["metadata"], raw["spec"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert meta["labels"]["weightlift.dev/deployment"] == "templated"
    assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov-rail0"
    assert spec["affinity"] == FULL["spec"]["affinity"]
    assert (spec["priorityClassName"], spec["priority"]) == ("inference-high", 1000)
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert {"licenses", "scratch", "plan"} <= {v["name"] for v in spec["volumes"]}
    assert [c["name"] for c in spec["initContainers"]] == ["warmup"]
    worker, sidecar = spec["containers"]
    assert sidecar["name"] == "log-shipper" and sidecar["image"] == "fluent/fluent-bit:3.1"
    assert worker["command"] == ["weightlift", "worker"]
    assert worker["env"][-1]["name"] == "HF_TOKEN"
    assert worker["envFrom"] == [{"configMapRef": {"name": "tuning"}}]
    assert worker["resources"]["limits"]["rdma/rail1"] == "1"
    assert worker["resources"]["limits"]["example.com/fpga"] == "1"
    assert worker["securityContext"]["runAsUser"] == 2000
    assert worker["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_a_clash_only_the_render_sees_is_named_in_the_status(env: Env) -> None:  # noqa: F811
    env.create(
        "clash",
        template={"spec": {"containers": [{"name": "worker", "env": [{"name": "POD_IP"}]}]}},
    )

    def surfaced() -> dict[str, Any]:
        st = env.status("clash")
        return st if "POD_IP" in st.get("message", "") else {}

    st = wait_for(surfaced, 30, "the template clash in status.message")
    assert "env: POD_IP is set by the operator" in st["message"], st["message"]
    assert env.pods("clash") == []
