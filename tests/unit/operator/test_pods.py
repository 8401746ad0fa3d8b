"""Worker pod rendering: resources, security, labels, ownership, the worker plan and model mounts.

The manifests are also round-tripped through the kubernetes client's own V1Pod model so that a
misspelled field name (which the client would silently drop) fails here, not at the API server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from pydantic import ValidationError

from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    IDENTITY_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
    SPARE_LABEL,
)
from weightlift.api.model import (
    DEFAULT_GPU_RESOURCE,
    GROUP,
    KIND,
    VERSION,
    ModelDeploymentSpec,
    Role,
    SourceEndpoint,
)
from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    PEER_TOKEN_ENV,
    PLAN_FILE_ENV,
    PLAN_SHA256_ENV,
    Assignment,
    PeerHandoff,
    SharedPlan,
    WorkerPlan,
    plan_digest,
)
from weightlift.operator.identity import model_identity
from weightlift.operator.planning import DesiredPod, pod_name
from weightlift.operator.pods import (
    DOWNLOAD_DIR,
    PLAN_MOUNT,
    PVC_MOUNT_ROOT,
    model_mount,
    plan_for,
    render_pod,
)

GPU = DEFAULT_GPU_RESOURCE
NAME = "llama"
NAMESPACE = "ml"
UID = "0b7e6a52-5d0c-4f8e-9d7c-3e2a1f000001"


def make_spec(**overrides: Any) -> ModelDeploymentSpec:
    wire: dict[str, Any] = {"model": {"uri": "hostpath:///models/llama"}, "replicas": 2}
    wire.update(overrides)
    return ModelDeploymentSpec.model_validate(wire)


def source_endpoint(pod: str, ip: str) -> SourceEndpoint:
    return SourceEndpoint(
        pod=pod, deployment=NAME, address=f"{ip}:8000", model_identity="x", ranks=[0]
    )


def desired(
    spec: ModelDeploymentSpec,
    replica: int = 0,
    role: Role = Role.SOURCE,
    peers: list[SourceEndpoint] | None = None,
) -> DesiredPod:
    identity = model_identity(spec)
    return DesiredPod(
        name=pod_name(NAME, identity, replica),
        replica=replica,
        role=role,
        identity=identity,
        peers=peers or [],
    )


def render(spec: ModelDeploymentSpec, want: DesiredPod | None = None) -> dict[str, Any]:
    return render_pod(NAME, NAMESPACE, UID, spec, want or desired(spec))


def container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod["spec"]["containers"]
    assert len(containers) == 1
    worker: dict[str, Any] = containers[0]
    return worker


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container(pod)["env"]}


def plan_of(pod: dict[str, Any], spec: ModelDeploymentSpec | None = None) -> WorkerPlan:
    """The plan a worker of this pod reads: the ConfigMap's text (checked against the pod's
    digest) and the assignment in its env."""
    env = env_of(pod)
    identity = pod["metadata"]["labels"][IDENTITY_LABEL]
    configmap = plan_for(NAME, NAMESPACE, spec or make_spec(), identity)
    assert plan_digest(configmap.text) == env[PLAN_SHA256_ENV]["value"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "plan")
    assert volume == {"name": "plan", "configMap": {"name": configmap.name}}
    return WorkerPlan.compose(
        SharedPlan.model_validate_json(configmap.text),
        Assignment.model_validate_json(env[ASSIGNMENT_ENV]["value"]),
    )


def volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [v for v in pod["spec"]["volumes"] if v["name"] == name]
    assert len(matches) == 1, f"volume {name} appears {len(matches)} times"
    found: dict[str, Any] = matches[0]
    return found


def mounts(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container(pod)["volumeMounts"]}


# ------------------------------------------------------------------------------- resources


@pytest.mark.parametrize("tensor", [1, 2, 8])
def test_gpu_request_and_limit_equal_tensor_parallel_size(tensor: int) -> None:
    pod = render(make_spec(parallelism={"tensor": tensor}))
    resources = container(pod)["resources"]
    assert resources["limits"][GPU] == str(tensor)
    assert resources["requests"][GPU] == str(tensor)


def test_user_resources_are_merged_and_may_name_the_gpu_count_only_as_the_operator_sets_it() -> (
    None
):
    same = {"requests": {"cpu": "4", "memory": "32Gi", GPU: "4"}, "limits": {"memory": "64Gi"}}
    spec = make_spec(parallelism={"tensor": 4}, template={"resources": same})
    resources = container(render(spec))["resources"]
    assert resources["requests"] == {"cpu": "4", "memory": "32Gi", GPU: "4"}
    assert resources["limits"] == {"memory": "64Gi", GPU: "4"}
    for part in ("requests", "limits"):
        with pytest.raises(ValidationError, match=f"spec.template.resources.{part}: the GPU"):
            make_spec(parallelism={"tensor": 4}, template={"resources": {part: {GPU: "1"}}})


@pytest.mark.parametrize("resource", ["nvidia.com/mig-1g.10gb", "amd.com/gpu"])
def test_the_gpu_resource_is_the_templates(resource: str) -> None:
    spec = make_spec(
        parallelism={"tensor": 4, "podsPerReplica": 2}, template={"gpuResource": resource}
    )
    resources = container(render(spec))["resources"]
    assert resources["limits"] == {resource: "2"} and resources["requests"] == {resource: "2"}


@pytest.mark.parametrize("bad", ["gpu", "kubernetes.io/gpu", "x.kubernetes.io/gpu", "Nvidia.com/g"])
def test_a_gpu_resource_that_is_not_an_extended_resource_name_is_refused(bad: str) -> None:
    with pytest.raises(ValidationError, match="gpuResource"):
        make_spec(template={"gpuResource": bad})


def test_rdma_resource_is_requested_and_only_then_ipc_lock_is_added() -> None:
    plain = container(render(make_spec()))
    assert plain["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(k.startswith("rdma/") for k in plain["resources"]["limits"])

    rdma = container(render(make_spec(template={"rdmaResource": "rdma/ib"})))
    assert rdma["resources"]["limits"]["rdma/ib"] == "1"
    assert rdma["resources"]["requests"]["rdma/ib"] == "1"
    assert rdma["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_node_selector_and_tolerations_are_copied() -> None:
    spec = make_spec(
        template={
            "nodeSelector": {"gpu.example.com/class": "h100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "dedicated",
                    "value": "ml",
                    "effect": "NoExecute",
                    "tolerationSeconds": 60,
                },
            ],
        }
    )
    pod_spec = render(spec)["spec"]
    assert pod_spec["nodeSelector"] == {"gpu.example.com/class": "h100"}
    assert pod_spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {
            "key": "dedicated",
            "operator": "Equal",
            "value": "ml",
            "effect": "NoExecute",
            "tolerationSeconds": 60,
        },
    ]
    # Mutating the pod must not write through into the spec.
    pod_spec["nodeSelector"]["x"] = "y"
    assert "x" not in spec.template.node_selector


def test_dev_shm_is_a_memory_empty_dir_with_the_size_limit() -> None:
    pod = render(make_spec(template={"shmSize": "16Gi"}))
    dshm = volume(pod, "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert mounts(pod)["/dev/shm"]["name"] == "dshm"


# ------------------------------------------------------------------------- identity & owner


def test_labels_name_deployment_identity_role_replica_and_manager() -> None:
    spec = make_spec()
    want = desired(spec, replica=3, role=Role.TARGET)
    labels = render(spec, want)["metadata"]["labels"]
    assert labels[DEPLOYMENT_LABEL] == NAME
    assert labels[IDENTITY_LABEL] == model_identity(spec)
    assert labels[ROLE_LABEL] == "Target"
    assert labels[REPLICA_LABEL] == "3"
    assert labels["app.kubernetes.io/managed-by"] == "weightlift"
    # Label values must be valid: at most 63 characters, all strings.
    assert all(isinstance(v, str) and len(v) <= 63 for v in labels.values())


def test_pod_name_and_namespace_come_from_the_desired_pod() -> None:
    spec = make_spec()
    want = desired(spec, replica=1)
    meta = render(spec, want)["metadata"]
    assert meta["name"] == want.name
    assert meta["namespace"] == NAMESPACE


def test_owner_reference_makes_the_model_deployment_the_controller() -> None:
    owners = render(make_spec())["metadata"]["ownerReferences"]
    assert owners == [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": NAME,
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


# ------------------------------------------------------------------------------ worker plan


def test_worker_plan_env_parses_back_for_a_source() -> None:
    spec = make_spec(parallelism={"tensor": 2}, model={"uri": "hostpath:///m", "name": "served"})
    want = desired(spec, replica=0)
    plan = plan_of(render(spec, want), spec)
    assert plan.role == Role.SOURCE
    assert plan.deployment == NAME
    assert plan.namespace == NAMESPACE
    assert plan.pod_name == want.name
    assert plan.replica == 0
    assert plan.model_identity == want.identity
    assert plan.model_dir == "/m"
    assert plan.served_model_name == "served"
    assert plan.tensor_parallel == 2
    assert plan.ranks == [0, 1]
    assert plan.peers == []


def test_worker_plan_env_carries_the_peers_of_a_target_in_order() -> None:
    spec = make_spec()
    peers = [source_endpoint("llama-a-0", "10.0.0.5"), source_endpoint("other-b-0", "10.0.0.6")]
    pod = render(spec, desired(spec, replica=2, role=Role.TARGET, peers=peers))
    plan = plan_of(pod, spec)
    assert plan.role == Role.TARGET
    assert plan.replica == 2
    assert [(p.pod, p.address) for p in plan.peers] == [
        ("llama-a-0", "10.0.0.5:8000"),
        ("other-b-0", "10.0.0.6:8000"),
    ]
    # The same candidates in the hand-off annotation, projected into the worker's hand-off file.
    handoff = PeerHandoff.parse(pod["metadata"]["annotations"]["weightlift.dev/peers"])
    assert handoff is not None and not handoff.storage
    assert [(p.pod, p.address) for p in handoff.peers] == [
        ("llama-a-0", "10.0.0.5:8000"),
        ("other-b-0", "10.0.0.6:8000"),
    ]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "peers")
    (item,) = volume["downwardAPI"]["items"]
    assert item["fieldRef"]["fieldPath"] == "metadata.annotations['weightlift.dev/peers']"
    container = pod["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "peers")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WEIGHTLIFT_PEERS_FILE"] == f"{mount['mountPath']}/{item['path']}"


def test_a_target_in_standby_is_handed_nothing_yet_and_a_source_storage() -> None:
    spec = make_spec()
    waiting = render(spec, desired(spec, replica=1, role=Role.TARGET, peers=[]))
    assert waiting["metadata"]["annotations"]["weightlift.dev/peers"] == ""
    assert PeerHandoff.parse("") is None
    source = render(spec, desired(spec, replica=0, role=Role.SOURCE, peers=[]))
    handed = PeerHandoff.parse(source["metadata"]["annotations"]["weightlift.dev/peers"])
    assert handed is not None and handed.storage


def test_a_spare_is_a_labelled_target_that_waits_without_a_bound_of_its_own() -> None:
    """A warm spare: a Target in standby (nothing handed), labelled so the scale subresource's
    selector leaves it out, and told it is a spare so its worker never loads on its own."""
    from weightlift.worker.standby import SPARE_WAIT_SECONDS, starts_in_standby, wait_limit

    spec = make_spec(warmSpares=1)
    identity = model_identity(spec)
    want = DesiredPod(pod_name(NAME, identity, 2), 2, Role.TARGET, identity, [], spare=True)
    pod = render(spec, want)
    assert pod["metadata"]["labels"][SPARE_LABEL] == "true"
    assert pod["metadata"]["annotations"]["weightlift.dev/peers"] == ""
    plan = plan_of(pod, spec)
    assert plan.spare is True and plan.role == Role.TARGET and plan.peers == []
    assert starts_in_standby(plan, Path("/etc/weightlift/peers/peers.json"))
    assert wait_limit(plan) == SPARE_WAIT_SECONDS
    # A replica is no spare: no label, no flag in its assignment, the usual bounded wait.
    replica = render(spec, desired(spec, replica=1, role=Role.TARGET))
    assert SPARE_LABEL not in replica["metadata"]["labels"]
    assert "spare" not in env_of(replica)[ASSIGNMENT_ENV]["value"]
    assert wait_limit(plan_of(replica, spec)) < 3600


def test_worker_plan_defaults_the_served_name_to_the_deployment() -> None:
    assert plan_of(render(make_spec())).served_model_name == NAME


def test_the_plan_is_a_mounted_file_and_only_the_assignment_is_env() -> None:
    spec = make_spec(template={"env": [{"name": "HF_HOME", "value": "/tmp/hf"}]})
    pod = render(spec)
    env = env_of(pod)
    assert env[PLAN_FILE_ENV]["value"] == f"{PLAN_MOUNT}/plan.json"
    assert {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True} in container(pod)[
        "volumeMounts"
    ]
    raw = env[ASSIGNMENT_ENV]["value"]
    assert set(json.loads(raw)) == {"podName", "replica", "role", "modelDir", "peers"}
    assert len(raw) < 300
    token = env[PEER_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    assert token == {"name": f"weightlift-peer-{model_identity(spec)}", "key": "token"}
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": "/tmp/hf"}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_external_runtime_command_is_the_container_command_unchanged() -> None:
    command = ["tritonserver", "--model-repository", "/models/my repo", "--log-verbose=1"]
    spec = make_spec(runtime={"type": "External", "command": command, "port": 8001})
    pod = render(spec)
    assert container(pod)["command"] == command
    assert container(render(make_spec()))["command"] == ["weightlift", "worker"]
    assert container(pod)["ports"] == [{"name": "http", "containerPort": 8001, "protocol": "TCP"}]


# --------------------------------------------------------------------------- probes, safety


def test_readiness_probe_hits_the_kserve_ready_endpoint_on_the_http_port() -> None:
    worker = container(render(make_spec()))
    ready = worker["readinessProbe"]["httpGet"]
    assert ready["path"] == "/v2/health/ready"
    assert ready["port"] == "http"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert [p["name"] for p in worker["ports"]] == ["http"]


def test_security_context_is_non_root_read_only_without_privilege() -> None:
    pod = render(make_spec())
    pod_security = pod["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] != 0
    security = container(pod)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in security or security["privileged"] is False
    # A read-only root needs a writable /tmp.
    assert volume(pod, "tmp")["emptyDir"] == {}
    assert mounts(pod)["/tmp"]["name"] == "tmp"


def test_pods_are_never_restarted_in_place() -> None:
    assert render(make_spec())["spec"]["restartPolicy"] == "Never"


# ------------------------------------------------------------------------------ model mount


def test_hostpath_is_mounted_read_only_at_the_same_path() -> None:
    spec = make_spec(model={"uri": "hostpath:///data/models/llama"})
    model_dir, volumes, volume_mounts = model_mount(spec)
    assert model_dir == "/data/models/llama"
    assert volumes == [
        {"name": "model", "hostPath": {"path": "/data/models/llama", "type": "Directory"}}
    ]
    assert volume_mounts == [{"name": "model", "mountPath": "/data/models/llama", "readOnly": True}]
    pod = render(spec)
    assert mounts(pod)["/data/models/llama"]["readOnly"] is True
    assert plan_of(pod, spec).model_dir == "/data/models/llama"


def test_pvc_mounts_the_claim_and_the_model_dir_includes_the_sub_path() -> None:
    spec = make_spec(model={"uri": "pvc://weights/llama-3/8b"})
    model_dir, volumes, volume_mounts = model_mount(spec)
    root = f"{PVC_MOUNT_ROOT}/weights"
    assert model_dir == f"{root}/llama-3/8b"
    assert volumes == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    ]
    assert volume_mounts == [{"name": "model", "mountPath": root, "readOnly": True}]
    assert plan_of(render(spec), spec).model_dir == f"{root}/llama-3/8b"


def test_file_uri_is_a_path_in_the_image_without_a_volume() -> None:
    spec = make_spec(model={"uri": "file:///opt/models/demo"})
    assert model_mount(spec) == ("/opt/models/demo", [], [])
    pod = render(spec)
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "tmp", "plan", "peers"}
    assert plan_of(pod, spec).model_dir == "/opt/models/demo"


def test_s3_downloads_into_an_empty_dir_with_secret_refs_for_credentials() -> None:
    spec = make_spec(
        model={"uri": "s3://models/llama", "credentials": {"name": "s3-creds"}, "region": "eu-1"}
    )
    pod = render(spec)
    assert plan_of(pod, spec).model_dir == DOWNLOAD_DIR
    assert volume(pod, "model") == {"name": "model", "emptyDir": {}}
    assert mounts(pod)[DOWNLOAD_DIR].get("readOnly") is not True
    creds = {
        e["name"]: e
        for e in container(pod)["env"]
        if "secretKeyRef" in e.get("valueFrom", {}) and e["name"] != PEER_TOKEN_ENV
    }
    assert sorted(creds) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]
    for name, e in creds.items():
        assert e["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": name, "optional": True}
        assert "value" not in e
    # The plan names the Secret, never a value.
    assert plan_of(pod, spec).model.credentials is not None
    assert "model-cache" not in {v["name"] for v in pod["spec"]["volumes"]}


def test_hf_token_ref_and_the_node_cache_is_a_host_path_at_the_same_path() -> None:
    spec = make_spec(
        model={"uri": "hf://acme/tiny@v1", "credentials": {"name": "hf"}},
        loading={"cache": {"enabled": True, "path": "/var/cache/wl", "maxSizeGiB": 5}},
    )
    pod = render(spec)
    refs = [e["name"] for e in container(pod)["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs == [PEER_TOKEN_ENV, "HF_TOKEN"]
    assert volume(pod, "model-cache")["hostPath"] == {
        "path": "/var/cache/wl",
        "type": "DirectoryOrCreate",
    }
    assert mounts(pod)["/var/cache/wl"]["name"] == "model-cache"
    assert plan_of(pod, spec).loading.cache.max_size_gib == 5


# ----------------------------------------------------------------- the real Kubernetes schema


def _roundtrip(manifest: dict[str, Any]) -> Any:
    """What create_namespaced_pod sends: the client validates the dict into its V1Pod model
    (extra fields forbidden) and serializes that model back to JSON."""
    pod = client.V1Pod.model_validate(manifest)
    return client.ApiClient().sanitize_for_serialization(pod)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model": {"uri": "pvc://weights/llama"}, "template": {"rdmaResource": "rdma/ib"}},
        {
            "model": {
                "uri": "s3://b/m",
                "endpoint": "http://s3:9000",
                "credentials": {"name": "c"},
            },
            "loading": {"cache": {"enabled": True}},
        },
        {
            "model": {"uri": "file:///opt/m"},
            "runtime": {"type": "External", "command": ["vllm", "serve"]},
            "template": {
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "nodeSelector": {"a": "b"},
                "env": [{"name": "X", "value": "1"}],
            },
        },
    ],
)
def test_rendered_pod_survives_the_kubernetes_v1pod_model(overrides: dict[str, Any]) -> None:
    """A lossless round trip means every field name, nesting and type in the manifest is one
    the Pod schema has, and nothing is dropped or rewritten on the way to the API server."""
    spec = make_spec(**overrides)
    peers = [source_endpoint("llama-a-0", "10.0.0.5")]
    manifest = render(spec, desired(spec, replica=1, role=Role.TARGET, peers=peers))
    assert _roundtrip(manifest) == manifest


def test_roundtrip_check_catches_a_misspelled_field() -> None:
    manifest = render(make_spec())
    manifest["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 1}
    with pytest.raises(ValidationError, match="readinesProbe"):
        _roundtrip(manifest)


def test_default_service_account_gets_no_api_token() -> None:
    spec = render(make_spec())["spec"]
    assert "serviceAccountName" not in spec
    assert spec["automountServiceAccountToken"] is False


def test_named_service_account_is_used_with_its_token() -> None:
    spec = render(make_spec(template={"serviceAccountName": "weightlift-worker"}))["spec"]
    assert spec["serviceAccountName"] == "weightlift-worker"
    assert "automountServiceAccountToken" not in spec


def test_the_operators_pull_secrets_reach_every_worker_pod_in_order() -> None:
    from weightlift.operator.settings import WORKER_IMAGE_PULL_SECRETS_ENV, Settings

    spec = make_spec()
    assert "imagePullSecrets" not in render(spec)["spec"], "none configured: no key"
    settings = Settings.from_environment({WORKER_IMAGE_PULL_SECRETS_ENV: "regcred, mirror,regcred"})
    pod = render_pod(NAME, NAMESPACE, UID, spec, desired(spec), None, settings)
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert _roundtrip(pod) == pod
    with pytest.raises(ValueError, match=f"{WORKER_IMAGE_PULL_SECRETS_ENV}: 'Bad_Name'"):
        Settings.from_environment({WORKER_IMAGE_PULL_SECRETS_ENV: "ok,Bad_Name"})


def test_a_bad_pull_secret_flag_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from weightlift.operator.run import operator_command
    from weightlift.operator.settings import WORKER_IMAGE_PULL_SECRETS_ENV

    monkeypatch.setenv(WORKER_IMAGE_PULL_SECRETS_ENV, "")  # restored after: the flag sets it
    argv = ["-n", "ml", "--worker-image-pull-secret", "ok", "--worker-image-pull-secret", "Bad_X"]
    result = CliRunner().invoke(operator_command, argv)
    assert result.exit_code == 2, result.output
    assert "--worker-image-pull-secret" in result.output and "'Bad_X'" in result.output


def test_the_operators_compile_cache_bound_reaches_its_workers() -> None:
    from weightlift.api.worker import COMPILE_CACHE_MAX_BYTES_ENV
    from weightlift.operator.settings import Settings

    spec = make_spec()
    assert COMPILE_CACHE_MAX_BYTES_ENV not in env_of(render(spec))
    bounded = render_pod(
        NAME, NAMESPACE, UID, spec, desired(spec), None, Settings(compile_cache_max_bytes=4096)
    )
    assert env_of(bounded)[COMPILE_CACHE_MAX_BYTES_ENV]["value"] == "4096"
    assert (
        Settings.from_environment({COMPILE_CACHE_MAX_BYTES_ENV: "4096"}).compile_cache_max_bytes
        == 4096
    )
    with pytest.raises(ValueError, match=COMPILE_CACHE_MAX_BYTES_ENV):
        Settings.from_environment({COMPILE_CACHE_MAX_BYTES_ENV: "-1"})


def test_a_vllm_worker_gets_the_node_compile_store_as_a_hostpath_and_env() -> None:
    from weightlift.api.worker import (
        COMPILE_STORE_ENV,
        COMPILE_STORE_MAX_BYTES_ENV,
        DEFAULT_COMPILE_STORE,
    )
    from weightlift.operator.settings import Settings

    vllm = make_spec(
        model={"uri": "hostpath:///models/llama", "format": "safetensors"},
        runtime={"engine": "vLLM"},
    )
    pod = render_pod(NAME, NAMESPACE, UID, vllm, desired(vllm), None, Settings())
    env = env_of(pod)
    assert env[COMPILE_STORE_ENV]["value"] == DEFAULT_COMPILE_STORE
    assert env[COMPILE_STORE_MAX_BYTES_ENV]["value"] == str(4 << 30)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-store"]
    assert volume["hostPath"] == {"path": DEFAULT_COMPILE_STORE, "type": "DirectoryOrCreate"}
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "compile-store", "mountPath": DEFAULT_COMPILE_STORE} in mounts
    # The builtin engine compiles nothing: no store; and "" turns the store off.
    builtin = make_spec()
    assert COMPILE_STORE_ENV not in env_of(
        render_pod(NAME, NAMESPACE, UID, builtin, desired(builtin), None, Settings())
    )
    off = render_pod(NAME, NAMESPACE, UID, vllm, desired(vllm), None, Settings(compile_store=""))
    assert COMPILE_STORE_ENV not in env_of(off)
    assert all(v["name"] != "compile-store" for v in off["spec"]["volumes"])
    settings = Settings.from_environment(
        {COMPILE_STORE_ENV: "/srv/wl-store/", COMPILE_STORE_MAX_BYTES_ENV: "1000"}
    )
    assert (settings.compile_store, settings.compile_store_max_bytes) == ("/srv/wl-store", 1000)
    assert Settings.from_environment({COMPILE_STORE_ENV: ""}).compile_store == ""
    with pytest.raises(ValueError, match=COMPILE_STORE_ENV):
        Settings.from_environment({COMPILE_STORE_ENV: "relative/path"})
    with pytest.raises(ValueError, match=COMPILE_STORE_MAX_BYTES_ENV):
        Settings.from_environment({COMPILE_STORE_MAX_BYTES_ENV: "-5"})


def test_the_cluster_store_reaches_vllm_workers_with_credentials_by_secret_reference() -> None:
    from weightlift.api.worker import (
        COMPILE_STORE_ACCESS_KEY_ENV,
        COMPILE_STORE_MAX_BYTES_ENV,
        COMPILE_STORE_S3_ENDPOINT_ENV,
        COMPILE_STORE_SECRET_KEY_ENV,
        COMPILE_STORE_URI_ENV,
    )
    from weightlift.operator.settings import COMPILE_STORE_SECRET_ENV, Settings

    vllm = make_spec(
        model={"uri": "hostpath:///models/llama", "format": "safetensors"},
        runtime={"engine": "vLLM"},
    )
    settings = Settings.from_environment(
        {
            COMPILE_STORE_URI_ENV: "s3://caches/wl",
            COMPILE_STORE_S3_ENDPOINT_ENV: "http://minio:9000",
            COMPILE_STORE_SECRET_ENV: "cc-creds",
            "WEIGHTLIFT_COMPILE_STORE": "",
        }
    )
    env = env_of(render_pod(NAME, NAMESPACE, UID, vllm, desired(vllm), None, settings))
    assert env[COMPILE_STORE_URI_ENV]["value"] == "s3://caches/wl"
    assert env[COMPILE_STORE_S3_ENDPOINT_ENV]["value"] == "http://minio:9000"
    assert env[COMPILE_STORE_MAX_BYTES_ENV]["value"] == str(4 << 30)
    for name, key in (
        (COMPILE_STORE_ACCESS_KEY_ENV, "AWS_ACCESS_KEY_ID"),
        (COMPILE_STORE_SECRET_KEY_ENV, "AWS_SECRET_ACCESS_KEY"),
    ):
        assert env[name] == {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": "cc-creds", "key": key, "optional": True}},
        }
    with pytest.raises(ValueError, match=COMPILE_STORE_URI_ENV):
        Settings.from_environment({COMPILE_STORE_URI_ENV: "gs://nope"})


def test_a_pvc_cluster_store_is_the_claim_mounted_in_vllm_workers() -> None:
    from weightlift.api.worker import COMPILE_STORE_SHARED_ENV, COMPILE_STORE_URI_ENV
    from weightlift.operator.pods import SHARED_STORE_MOUNT
    from weightlift.operator.settings import Settings

    vllm = make_spec(
        model={"uri": "hostpath:///models/llama", "format": "safetensors"},
        runtime={"engine": "vLLM"},
    )
    settings = Settings.from_environment({COMPILE_STORE_URI_ENV: "pvc://caches/wl/cc"})
    pod = render_pod(NAME, NAMESPACE, UID, vllm, desired(vllm), None, settings)
    env = env_of(pod)
    assert env[COMPILE_STORE_SHARED_ENV]["value"] == f"{SHARED_STORE_MOUNT}/wl/cc"
    assert COMPILE_STORE_URI_ENV not in env  # the worker sees a directory, not a URI
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-store-shared"]
    assert volume["persistentVolumeClaim"] == {"claimName": "caches"}
    mounts = container(pod)["volumeMounts"]
    assert {"name": "compile-store-shared", "mountPath": SHARED_STORE_MOUNT} in mounts
    builtin = make_spec()
    plain = render_pod(NAME, NAMESPACE, UID, builtin, desired(builtin), None, settings)
    assert all(v["name"] != "compile-store-shared" for v in plain["spec"]["volumes"])
    with pytest.raises(ValueError, match=COMPILE_STORE_URI_ENV):
        Settings.from_environment({COMPILE_STORE_URI_ENV: "pvc://claim/../etc"})
