"""spec.template's metadata and PodSpec parts merged into the rendered worker pod
(operator/podtemplate.py): the user's additions land, the operator's own fields win. ~1 s."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.unit.operator.test_pods import NAME, NAMESPACE, UID, desired
from weightlift.api.labels import DEPLOYMENT_LABEL, PEERS_ANNOTATION
from weightlift.api.model import (
    DEFAULT_GPU_RESOURCE,
    ModelDeploymentSpec,
    PodTemplate,
    WorkerPodSpec,
)
from weightlift.api.podspec import WORKER_MOUNT_ROOTS, WORKER_VOLUMES
from weightlift.operator.pods import render_pod
from weightlift.operator.podtemplate import TemplateConflict, merge_template
from weightlift.operator.settings import Settings

MULTUS = "k8s.v1.cni.cncf.io/networks"
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
            ]
        }
    }
}
SIDECAR = {"name": "log-shipper", "image": "fluent/fluent-bit:3.1", "args": ["-c", "/cfg"]}
FULL_TEMPLATE: dict[str, Any] = {
    "rdmaResource": "rdma/rail0",
    "rdmaResources": ["rdma/rail1"],
    "metadata": {
        "labels": {"kueue.x-k8s.io/queue-name": "gpu", "team": "ml"},
        "annotations": {MULTUS: "sriov-rail0,sriov-rail1"},
    },
    "spec": {
        "affinity": AFFINITY,
        "priorityClassName": "inference-high",
        "schedulerName": "volcano",
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "imagePullSecrets": [{"name": "registry-creds"}],
        "volumes": [
            {"name": "licenses", "secret": {"secretName": "licenses"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": 1000000}},
        ],
        "initContainers": [{"name": "warmup", "image": "busybox:1.36", "command": ["true"]}],
        "containers": [
            {
                "name": "worker",
                "env": [
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
                ],
                "envFrom": [{"configMapRef": {"name": "tuning"}}],
                "volumeMounts": [{"name": "licenses", "mountPath": "/licenses", "readOnly": True}],
                "resources": {"limits": {"example.com/fpga": 1, "memory": "64Gi"}},
                "securityContext": {
                    "runAsUser": 2000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            },
            SIDECAR,
        ],
        "securityContext": {"fsGroup": 3000, "supplementalGroups": [44]},
    },
}


def spec_with(template: dict[str, Any]) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.model_validate(
        {"model": {"uri": "hostpath:///models/llama"}, "template": template}
    )


def render(spec: ModelDeploymentSpec, settings: Settings | None = None) -> dict[str, Any]:
    return render_pod(NAME, NAMESPACE, UID, spec, desired(spec), settings=settings)


def worker_of(pod: dict[str, Any]) -> dict[str, Any]:
    [worker] = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
    return worker


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    return render(spec_with(FULL_TEMPLATE))


def test_a_full_template_is_a_valid_pod(pod: dict[str, Any]) -> None:
    # The kubernetes client's own model: a misspelled field would be dropped here. It refuses
    # a Quantity written as a number (`example.com/fpga: 1`), which the API server admits.
    client.V1Pod.model_validate(pod)  # what create_namespaced_pod checks its body with
    worker = worker_of(pod)
    assert worker["resources"]["limits"]["example.com/fpga"] == "1"
    assert pod["spec"]["volumes"][-1]["emptyDir"]["sizeLimit"] == "1000000"
    api = client.ApiClient()
    typed = api._ApiClient__deserialize(pod, "V1Pod")  # type: ignore[attr-defined]
    back = api.sanitize_for_serialization(typed)
    assert back["spec"]["affinity"] == AFFINITY
    assert back["spec"]["containers"][1]["image"] == SIDECAR["image"]


def test_metadata_is_merged_under_the_operators(pod: dict[str, Any]) -> None:
    meta = pod["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert meta["labels"][DEPLOYMENT_LABEL] == NAME
    assert meta["annotations"][MULTUS] == "sriov-rail0,sriov-rail1"
    assert PEERS_ANNOTATION in meta["annotations"]


def test_pod_fields_are_copied_and_lists_appended(pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    assert spec["affinity"] == AFFINITY
    assert (spec["priorityClassName"], spec["schedulerName"], spec["runtimeClassName"]) == (
        "inference-high",
        "volcano",
        "nvidia",
    )
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert [c["name"] for c in spec["initContainers"]] == ["warmup"]
    assert [c["name"] for c in spec["containers"]] == ["worker", "log-shipper"]
    assert spec["containers"][1] == SIDECAR
    names = [v["name"] for v in spec["volumes"]]
    assert names[-2:] == ["licenses", "scratch"] and {"dshm", "tmp", "plan"} <= set(names)


def test_worker_overrides_are_merged_and_the_operators_fields_win(pod: dict[str, Any]) -> None:
    worker = worker_of(pod)
    assert worker["command"] == ["weightlift", "worker"]
    env = [e["name"] for e in worker["env"]]
    assert env[0].startswith("WEIGHTLIFT_") and env[-1] == "HF_TOKEN"
    assert worker["envFrom"] == [{"configMapRef": {"name": "tuning"}}]
    assert worker["volumeMounts"][-1]["mountPath"] == "/licenses"
    limits = worker["resources"]["limits"]
    assert limits["example.com/fpga"] == "1" and limits["memory"] == "64Gi"
    assert limits[DEFAULT_GPU_RESOURCE] == "1"
    assert limits["rdma/rail0"] == limits["rdma/rail1"] == "1"
    sc = worker["securityContext"]
    assert sc["runAsUser"] == 2000
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    pod_sc = pod["spec"]["securityContext"]
    assert pod_sc["fsGroup"] == 3000 and pod_sc["supplementalGroups"] == [44]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"


def test_no_template_parts_leave_the_pod_as_rendered() -> None:
    spec = spec_with({})
    base = render(spec)
    assert merge_template(base, spec.template) == base
    assert "affinity" not in base["spec"] and "initContainers" not in base["spec"]


def test_merge_does_not_touch_its_input(pod: dict[str, Any]) -> None:
    spec = spec_with(FULL_TEMPLATE)
    base = render(spec_with({}))
    before = repr(base)
    merge_template(base, spec.template)
    assert repr(base) == before


def test_the_operators_volumes_and_mounts_are_what_admission_reserves() -> None:
    """api/podspec.py's reserved names and paths cover every volume the operator renders."""
    settings = Settings(compile_store="/var/cache/weightlift/compile", compile_store_uri="")
    for uri, runtime in (
        ("hostpath:///models/llama", {}),
        ("s3://bucket/m", {}),
        ("pvc://claim/m", {"engine": "vLLM"}),
    ):
        fmt = {"format": "safetensors"} if runtime else {}
        spec = ModelDeploymentSpec.model_validate(
            {
                "model": {"uri": uri, **fmt},
                "runtime": runtime,
                "loading": {"cache": {"enabled": True}},
            }
        )
        pod = render(spec, settings)
        assert {v["name"] for v in pod["spec"]["volumes"]} <= set(WORKER_VOLUMES)
        for mount in worker_of(pod)["volumeMounts"]:
            path = mount["mountPath"]
            if path.startswith(("/models", "/var/cache")):
                continue  # hostpath:// dirs and the node stores: checked at merge (below)
            assert any(path == r or path.startswith(r + "/") for r in WORKER_MOUNT_ROOTS), path


def test_a_mount_on_the_models_directory_is_refused_at_merge() -> None:
    template = {
        "spec": {
            "volumes": [{"name": "extra", "emptyDir": {}}],
            "containers": [
                {
                    "name": "worker",
                    "volumeMounts": [{"name": "extra", "mountPath": "/models/llama"}],
                }
            ],
        }
    }
    with pytest.raises(TemplateConflict, match=r"volumeMounts: /models/llama is the worker's"):
        render(spec_with(template))


def test_an_unadmitted_volume_clash_is_refused_at_merge() -> None:
    # model_construct skips validation, as a spec that never passed admission might.
    spec = WorkerPodSpec.model_construct(volumes=[{"name": "plan", "emptyDir": {}}], containers=[])
    template = PodTemplate.model_construct(metadata=None, rdma_resources=[], spec=spec)
    base = render(spec_with({}))
    with pytest.raises(TemplateConflict, match=r"spec.template.spec.volumes: 'plan'"):
        merge_template(base, template)


def test_an_env_name_the_operator_sets_is_refused_at_merge() -> None:
    """The storage credentials' env (secretKeyRef) is the operator's when model.credentials is
    set: a worker override of the same name is a clash, not a silent second value."""
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": {"uri": "hf://org/m", "format": "safetensors", "credentials": {"name": "hf"}},
            "runtime": {"engine": "vLLM"},
            "template": {
                "spec": {"containers": [{"name": "worker", "env": [{"name": "HF_TOKEN"}]}]}
            },
        }
    )
    with pytest.raises(TemplateConflict, match=r"env: HF_TOKEN is set by the operator"):
        render(spec)
