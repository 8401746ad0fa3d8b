"""Render worker pods: pure functions from (ModelDeployment, desired pod) to a Pod manifest."""

from __future__ import annotations

from typing import Any

from weightlift.api.labels import (
    DEPLOYMENT_LABEL,
    IDENTITY_LABEL,
    INFERENCE_PROBE_GATE,
    PEERS_ANNOTATION,
    PLAN_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
    SERVING_LABEL,
    SPARE_LABEL,
    TEMPLATE_LABEL,
    WORKER_LABELS,
)
from weightlift.api.model import (
    DEFAULT_STARTUP_SECONDS,
    GROUP,
    KIND,
    VERSION,
    Engine,
    ModelDeploymentSpec,
    Role,
    RuntimeSpec,
    RuntimeType,
)
from weightlift.api.uri import REMOTE_SCHEMES, ModelUri
from weightlift.api.worker import (
    ASSIGNMENT_ENV,
    COMPILE_CACHE_MAX_BYTES_ENV,
    COMPILE_STORE_ACCESS_KEY_ENV,
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    COMPILE_STORE_S3_ENDPOINT_ENV,
    COMPILE_STORE_SECRET_KEY_ENV,
    COMPILE_STORE_SHARED_ENV,
    COMPILE_STORE_URI_ENV,
    PEER_TOKEN_ENV,
    PEER_TOKEN_KEY,
    PEERS_FILE,
    PEERS_FILE_ENV,
    PLAN_CONFIGMAP_ENV,
    PLAN_FILE_ENV,
    PLAN_KEY,
    PLAN_SHA256_ENV,
    Assignment,
    PeerCandidate,
    PeerHandoff,
    SharedPlan,
)
from weightlift.operator.identity import pod_template_revision
from weightlift.operator.inject import inject_worker, injected
from weightlift.operator.planning import DesiredPod
from weightlift.operator.podtemplate import merge_template
from weightlift.operator.settings import Settings
from weightlift.operator.shared_objects import PlanConfigMap, plan_configmap, token_secret_name

PVC_MOUNT_ROOT = "/mnt/models"
# Where a pvc:// cluster compile store is mounted in a vLLM worker.
SHARED_STORE_MOUNT = "/var/run/weightlift/compile-store"
# s3:// and hf:// models are downloaded here (an emptyDir) unless the node cache holds them.
DOWNLOAD_DIR = "/var/lib/weightlift/model"
# Secret keys the worker reads as environment, per scheme (boto3's and huggingface_hub's names).
CREDENTIAL_KEYS = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    "hf": ("HF_TOKEN",),
}
WORKER_UID = 1000
PLAN_MOUNT = "/etc/weightlift/plan"
# The hand-off file: the pod's weightlift.dev/peers annotation, projected by a downwardAPI
# volume. The kubelet rewrites it in place (an atomic ..data symlink swap) when the operator
# changes the annotation: how a Target started in standby learns its peers, with no restart.
PEERS_MOUNT = "/etc/weightlift/peers"


def model_mount(
    spec: ModelDeploymentSpec,
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Where the worker finds the model, plus the volumes and mounts that put it there.

    hostpath:// mounts the node directory at the same path (so the local process node and a real
    kubelet agree); file:// is a directory inside the image; pvc://claim/path mounts the claim.
    """
    uri = ModelUri.parse(spec.model.uri)
    if uri.scheme == "hostpath":
        volume = {"name": "model", "hostPath": {"path": uri.path, "type": "Directory"}}
        return uri.path, [volume], [{"name": "model", "mountPath": uri.path, "readOnly": True}]
    if uri.scheme == "pvc":
        root = f"{PVC_MOUNT_ROOT}/{uri.claim}"
        claim = {"claimName": uri.claim, "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        mount = {"name": "model", "mountPath": root, "readOnly": True}
        return f"{root}/{uri.path}".rstrip("/"), [volume], [mount]
    if uri.scheme in REMOTE_SCHEMES:
        volumes = [{"name": "model", "emptyDir": {}}]
        mounts = [{"name": "model", "mountPath": DOWNLOAD_DIR}]
        cache = spec.loading.cache
        if cache.enabled:
            # The same path on the node and in the pod: the local process node and a kubelet agree.
            volumes.append(
                {
                    "name": "model-cache",
                    "hostPath": {"path": cache.path, "type": "DirectoryOrCreate"},
                }
            )
            mounts.append({"name": "model-cache", "mountPath": cache.path})
        return DOWNLOAD_DIR, volumes, mounts
    # file:// and anything planning let through: a path inside the image.
    return uri.path, [], []


def credential_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The storage credentials as secretKeyRef env: the values never pass through the operator."""
    ref = spec.model.credentials
    if ref is None:
        return []
    keys = CREDENTIAL_KEYS.get(ModelUri.parse(spec.model.uri).scheme, ())
    return [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": k, "optional": True}}}
        for k in keys
    ]


def shared_plan(name: str, namespace: str, spec: ModelDeploymentSpec, identity: str) -> SharedPlan:
    """What every replica of this revision is told (the plan ConfigMap's content)."""
    return SharedPlan(
        namespace=namespace,
        deployment=name,
        model_identity=identity,
        model=spec.model,
        served_model_name=spec.model.name or name,
        tensor_parallel=spec.parallelism.tensor,
        ranks=list(range(spec.parallelism.tensor)),
        pods_per_replica=spec.parallelism.pods_per_replica
        if spec.parallelism.pods_per_replica > 1
        else None,
        loading=spec.loading,
        init_hooks=spec.init_hooks,
        runtime=spec.runtime,
        probe=spec.probe,
    )


def assignment(spec: ModelDeploymentSpec, desired: DesiredPod) -> Assignment:
    model_dir, _, _ = model_mount(spec)
    return Assignment(
        pod_name=desired.name,
        replica=desired.replica,
        role=desired.role,
        model_dir=model_dir,
        peers=[PeerCandidate(pod=s.pod, address=s.address) for s in desired.peers],
        spare=desired.spare or None,
    )


def plan_for(name: str, namespace: str, spec: ModelDeploymentSpec, identity: str) -> PlanConfigMap:
    return plan_configmap(name, shared_plan(name, namespace, spec, identity))


def operator_settings_env(
    settings: Settings | None, spec: ModelDeploymentSpec | None = None
) -> list[dict[str, Any]]:
    """The operator's settings its workers apply (the compile-cache bound, the node store of a
    vLLM replica), when it has them."""
    if settings is None:
        return []
    env = []
    if settings.compile_cache_max_bytes is not None:
        env.append(
            {"name": COMPILE_CACHE_MAX_BYTES_ENV, "value": str(settings.compile_cache_max_bytes)}
        )
    if spec is not None and compile_store_volume(spec, settings):
        env.append({"name": COMPILE_STORE_ENV, "value": settings.compile_store})
    uri = settings.compile_store_uri
    if spec is not None and uri.startswith("s3://") and runs_vllm(spec):
        env += cluster_store_env(settings)
    if spec is not None and shared_store_volume(spec, settings):
        claim_path = uri.removeprefix("pvc://").partition("/")[2].strip("/")
        path = f"{SHARED_STORE_MOUNT}/{claim_path}".rstrip("/")
        env.append({"name": COMPILE_STORE_SHARED_ENV, "value": path})
    stores = (COMPILE_STORE_ENV, COMPILE_STORE_URI_ENV, COMPILE_STORE_SHARED_ENV)
    if any(e["name"] in stores for e in env):
        env.append(
            {"name": COMPILE_STORE_MAX_BYTES_ENV, "value": str(settings.compile_store_max_bytes)}
        )
    return env


def shared_store_volume(
    spec: ModelDeploymentSpec, settings: Settings | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The cluster store's ReadWriteMany claim (pvc://claim/path) as (volume, mount), for a
    worker that runs vLLM; None otherwise."""
    if settings is None or not settings.compile_store_uri.startswith("pvc://"):
        return None
    if not runs_vllm(spec):
        return None
    claim = settings.compile_store_uri.removeprefix("pvc://").partition("/")[0]
    volume = {"name": "compile-store-shared", "persistentVolumeClaim": {"claimName": claim}}
    return volume, {"name": "compile-store-shared", "mountPath": SHARED_STORE_MOUNT}


def runs_vllm(spec: ModelDeploymentSpec) -> bool:
    """A weightlift worker running vLLM: the only engine with a compile cache."""
    return spec.runtime.type == RuntimeType.BUILTIN and spec.runtime.engine == Engine.VLLM


def cluster_store_env(settings: Settings) -> list[dict[str, Any]]:
    """The cluster store's URI and endpoint; its credentials as secretKeyRef env, so the values
    never pass through the operator."""
    env: list[dict[str, Any]] = [
        {"name": COMPILE_STORE_URI_ENV, "value": settings.compile_store_uri}
    ]
    if settings.compile_store_s3_endpoint:
        env.append(
            {"name": COMPILE_STORE_S3_ENDPOINT_ENV, "value": settings.compile_store_s3_endpoint}
        )
    if settings.compile_store_secret:
        for name, key in (
            (COMPILE_STORE_ACCESS_KEY_ENV, "AWS_ACCESS_KEY_ID"),
            (COMPILE_STORE_SECRET_KEY_ENV, "AWS_SECRET_ACCESS_KEY"),
        ):
            ref = {"name": settings.compile_store_secret, "key": key, "optional": True}
            env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return env


def compile_store_volume(
    spec: ModelDeploymentSpec, settings: Settings | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The node's compile-cache store as a hostPath at the same path (volume, mount), for a
    worker that runs vLLM (the only engine with a compile cache); None otherwise."""
    if settings is None or not settings.compile_store or not runs_vllm(spec):
        return None
    path = settings.compile_store
    volume = {"name": "compile-store", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    return volume, {"name": "compile-store", "mountPath": path}


def plan_env(
    plan: PlanConfigMap, spec: ModelDeploymentSpec, desired: DesiredPod
) -> list[dict[str, Any]]:
    """Where the worker finds its plan and the digest it must have; the P2P token for workers
    that serve or pull peer-to-peer (an External runtime does neither)."""
    env: list[dict[str, Any]] = [
        {"name": PLAN_FILE_ENV, "value": f"{PLAN_MOUNT}/{PLAN_KEY}"},
        {"name": PLAN_SHA256_ENV, "value": plan.digest},
        {"name": PLAN_CONFIGMAP_ENV, "value": plan.name},
        {"name": ASSIGNMENT_ENV, "value": assignment(spec, desired).to_text()},
    ]
    if spec.runtime.type != RuntimeType.EXTERNAL:
        ref = {"name": token_secret_name(desired.identity), "key": PEER_TOKEN_KEY}
        env.append({"name": PEER_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}})
        env.append({"name": PEERS_FILE_ENV, "value": f"{PEERS_MOUNT}/{PEERS_FILE}"})
    return env


def handoff_annotation(desired: DesiredPod) -> str:
    """A Target created with candidates is handed them at once; one in standby gets nothing
    yet (empty) and waits; a Source reads storage and never this."""
    if desired.role == Role.SOURCE:
        return PeerHandoff(storage=True).to_text()
    peers = [PeerCandidate(pod=s.pod, address=s.address) for s in desired.peers]
    return PeerHandoff(peers=peers).to_text() if peers else ""


def handoff_volume() -> dict[str, Any]:
    item = {
        "path": PEERS_FILE,
        "fieldRef": {"fieldPath": f"metadata.annotations['{PEERS_ANNOTATION}']"},
    }
    return {"name": "peers", "downwardAPI": {"items": [item]}}


def image_pull_secrets(settings: Settings | None) -> dict[str, Any]:
    """The operator's default pull secrets (the chart's workerImagePullSecrets); none: no key."""
    names = settings.worker_image_pull_secrets if settings is not None else ()
    return {"imagePullSecrets": [{"name": n} for n in names]} if names else {}


def container_ports(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The worker's port, and Triton's own (HTTP, gRPC, metrics) with runtime.engine Triton."""
    rt = spec.runtime
    ports = [{"name": "http", "containerPort": rt.port, "protocol": "TCP"}]
    if rt.type == RuntimeType.BUILTIN and rt.engine == Engine.TRITON:
        for name, port in (
            ("triton-http", rt.engine_port),
            ("triton-grpc", rt.engine_grpc_port),
            ("triton-metrics", rt.engine_metrics_port),
        ):
            ports.append({"name": name, "containerPort": port, "protocol": "TCP"})
    return ports


STARTUP_PERIOD_SECONDS = 5


def external_startup_probe(runtime: RuntimeSpec) -> dict[str, Any]:
    """An External server (a stock vLLM, tritonserver) opens its port only after loading its
    weights; until its liveness path first answers, the kubelet's liveness probe waits."""
    seconds = runtime.startup_seconds or DEFAULT_STARTUP_SECONDS
    return {
        "httpGet": {"port": "http", "scheme": "HTTP", "path": runtime.health_paths[1]},
        "periodSeconds": STARTUP_PERIOD_SECONDS,
        "failureThreshold": -(-seconds // STARTUP_PERIOD_SECONDS),
    }


def render_pod(
    name: str,
    namespace: str,
    uid: str,
    spec: ModelDeploymentSpec,
    desired: DesiredPod,
    plan: PlanConfigMap | None = None,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """`plan`: the revision's plan ConfigMap (computed once per pass by the caller); `settings`:
    the operator's, those its workers apply."""
    _, model_volumes, model_mounts = model_mount(spec)
    for store in (compile_store_volume(spec, settings), shared_store_volume(spec, settings)):
        if store is not None:
            model_volumes, model_mounts = [*model_volumes, store[0]], [*model_mounts, store[1]]
    template = spec.template
    plan = plan or plan_for(name, namespace, spec, desired.identity)
    gpus = str(spec.parallelism.ranks_per_pod)  # a multi-pod replica: its pod's share
    # Admission allows the GPU resource in the template only with this same count.
    limits = {**template.resources.limits, template.gpu_resource: gpus}
    requests = {**template.resources.requests, template.gpu_resource: gpus}
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if template.rdma_resource:
        limits[template.rdma_resource] = requests[template.rdma_resource] = "1"
        capabilities["add"] = ["IPC_LOCK"]  # RDMA registers (pins) memory
    env = [
        *plan_env(plan, spec, desired),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *({"name": e.name, "value": e.value} for e in template.env),
        *credential_env(spec),
        *operator_settings_env(settings, spec),
    ]
    # An External runtime (tritonserver, vLLM) is the container's own command: it loads its
    # weights itself and serves its protocol on runtime.port, where the kubelet checks the health
    # paths that protocol answers (or the spec's) and the operator probes it.
    external = spec.runtime.type == RuntimeType.EXTERNAL
    http_get = {"port": "http", "scheme": "HTTP"}
    ready_path, live_path = spec.runtime.health_paths
    container: dict[str, Any] = {
        "name": "worker",
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": list(spec.runtime.command) if external else ["weightlift", "worker"],
        "env": env,
        "ports": container_ports(spec),
        "resources": {"limits": limits, "requests": requests},
        "readinessProbe": {
            "httpGet": {**http_get, "path": ready_path},
            # The kubelet's shortest period: a replica's Ready is on the path to its targets'.
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {**http_get, "path": live_path},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        **({"startupProbe": external_startup_probe(spec.runtime)} if external else {}),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": capabilities,
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
            *([] if external else [{"name": "peers", "mountPath": PEERS_MOUNT, "readOnly": True}]),
            *model_mounts,
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    handoff = handoff_annotation(desired)
    labels = {
        **WORKER_LABELS,
        DEPLOYMENT_LABEL: name,
        IDENTITY_LABEL: desired.identity,
        ROLE_LABEL: str(desired.role),
        REPLICA_LABEL: str(desired.replica),
        PLAN_LABEL: plan.label,
        TEMPLATE_LABEL: pod_template_revision(spec),
        # Off when a scale-up wakes the spare: the scale subresource's selector leaves it out.
        **({SPARE_LABEL: "true"} if desired.spare else {}),
        # Its Service's (service.py) once handed its weights; a standby Target gets it with its
        # hand-off (planning._serving).
        **({SERVING_LABEL: "true"} if handoff and not desired.spare else {}),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": desired.name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {PEERS_ANNOTATION: handoff},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "restartPolicy": "Never",
            **image_pull_secrets(settings),
            **(
                {"serviceAccountName": template.service_account_name}
                if template.service_account_name
                else {"automountServiceAccountToken": False}
            ),
            "terminationGracePeriodSeconds": 30,
            # The pod is Ready only once the operator set this condition True: its replica
            # passed the inference probe (KEP-580), so Services route to probed replicas only.
            "readinessGates": [{"conditionType": INFERENCE_PROBE_GATE}],
            "nodeSelector": dict(template.node_selector),
            "tolerations": [t.wire() for t in template.tolerations],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": WORKER_UID,
                "runAsGroup": WORKER_UID,
                "fsGroup": WORKER_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": template.shm_size}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "plan", "configMap": {"name": plan.name}},
                *([] if external else [handoff_volume()]),
                *model_volumes,
            ],
        },
    }
    if injected(spec):  # the team's own engine image (inject.py)
        s3_store = bool(settings and settings.compile_store_uri.startswith("s3://"))
        inject_worker(pod, spec, settings.worker_bundle_image if settings else None, s3_store)
    return merge_template(pod, template)


def role_of(pod_labels: dict[str, str]) -> Role:
    return Role(pod_labels.get(ROLE_LABEL, Role.SOURCE))
