"""The ModelDeployment API: one pydantic model, the single source of the CRD (see crd.py).

Field descriptions become the OpenAPI descriptions `kubectl explain` shows, so every spec field
has one. Names are camelCase on the wire (aliases) and snake_case in Python.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from weightlift.api import limits, podspec
from weightlift.api.uri import URI_PATTERN

GROUP = "weightlift.dev"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ["md", "mdep"]
DEFAULT_REVISION = "main"


class ApiModel(BaseModel):
    """camelCase on the wire, strict about unknown fields (the CRD prunes them anyway)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True
    )

    def wire(self) -> dict[str, Any]:
        """The JSON-ready dict as the API server stores it (camelCase, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ----------------------------------------------------------------------------------- spec


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """A CEL rule the API server checks at admission (x-kubernetes-validations)."""
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def _rules(*rules: dict[str, Any]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


LabelKey = Annotated[
    str, StringConstraints(pattern=limits.QUALIFIED_NAME, max_length=limits.QUALIFIED_NAME_MAX)
]
LabelValue = Annotated[
    str, StringConstraints(pattern=limits.LABEL_VALUE, max_length=limits.LABEL_VALUE_MAX)
]
Quantity = Annotated[
    str, StringConstraints(pattern=limits.QUANTITY, max_length=limits.QUANTITY_MAX)
]
Arg = Annotated[str, StringConstraints(pattern=limits.NO_NUL, max_length=limits.ARG_MAX_LENGTH)]
HttpPath = Annotated[
    str, StringConstraints(pattern=limits.HTTP_PATH, max_length=limits.HTTP_PATH_MAX)
]

# A '..' path segment: refused in model URIs and init library paths, so that a path admitted
# below a directory stays below it (the operator's planning.validate checks the same).
_DOTDOT_SEGMENT = r"(^|/)\.\.(/|$)"
_URI_DOTDOT_SEGMENT = r"://(.*/)?\.\.(/|$)"


class ModelFormat(StrEnum):
    SAFETENSORS = "safetensors"
    PT2 = "pt2"


class LoadStrategy(StrEnum):
    AUTO = "Auto"
    PEER_TO_PEER = "PeerToPeer"
    PRELOAD = "Preload"
    DIRECT = "Direct"


class RuntimeType(StrEnum):
    BUILTIN = "Builtin"
    EXTERNAL = "External"


class Engine(StrEnum):
    """What the weightlift worker serves the model with."""

    BUILTIN = "Builtin"
    VLLM = "vLLM"
    TRITON = "Triton"


class CompletionProtocol(StrEnum):
    OPENAI = "OpenAI"
    TRITON_GENERATE = "TritonGenerate"


class ServingProtocol(StrEnum):
    """The HTTP API an External runtime's server speaks (runtime.protocol)."""

    KSERVE_V2 = "KServeV2"
    TRITON = "Triton"
    OPENAI = "OpenAI"


@dataclass(frozen=True)
class ProtocolEndpoints:
    """What a server of one protocol answers: the kubelet's health paths (GET), the completion
    probes the operator may send it (the first is the default) and whether it answers KServe v2
    /v2/models/{m}/infer."""

    readiness_path: str
    liveness_path: str
    completions: tuple[CompletionProtocol, ...]
    infer: bool


# The one table the pod's health probes, the operator's inference probe and admission read.
PROTOCOL_ENDPOINTS: dict[ServingProtocol, ProtocolEndpoints] = {
    # KServe v2 (the Open Inference Protocol), and the worker's own front door: either completion
    # probe, OpenAI by default, as before runtimes named a protocol.
    ServingProtocol.KSERVE_V2: ProtocolEndpoints(
        "/v2/health/ready",
        "/v2/health/live",
        (CompletionProtocol.OPENAI, CompletionProtocol.TRITON_GENERATE),
        infer=True,
    ),
    # tritonserver: KServe v2 with its generate extension; it serves no /v1.
    ServingProtocol.TRITON: ProtocolEndpoints(
        "/v2/health/ready", "/v2/health/live", (CompletionProtocol.TRITON_GENERATE,), infer=True
    ),
    # vLLM's OpenAI server (`vllm serve`): GET /health answers 200 while its engine lives; no /v2.
    ServingProtocol.OPENAI: ProtocolEndpoints(
        "/health", "/health", (CompletionProtocol.OPENAI,), infer=False
    ),
}


class Role(StrEnum):
    SOURCE = "Source"
    TARGET = "Target"


class SecretReference(ApiModel):
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Name of a Secret in the ModelDeployment's namespace.",
    )


class ModelSource(ApiModel):
    model_config = _rules(
        _cel(
            f"!self.uri.matches(r'{_URI_DOTDOT_SEGMENT}')",
            "spec.model.uri: '.' and '..' path segments are not allowed; write the normalised path",
            ".uri",
        )
    )

    uri: str = Field(
        pattern=URI_PATTERN,
        max_length=2048,
        description=(
            "Where the weights live: pvc://<claim>/<path>, hostpath:///<dir>, file:///<dir> "
            "(inside the worker image), s3://<bucket>/<prefix> or hf://<org>/<repo>[@<revision>]."
        ),
    )
    format: ModelFormat = Field(
        ModelFormat.PT2,
        description=(
            "pt2: a model.pt2 program (torch.export / AOTInductor) with sidecar safetensors; "
            "safetensors: a Hugging Face model directory (config.json, tokenizer files, "
            "*.safetensors) served by runtime.engine vLLM, or by an External runtime."
        ),
    )
    revision: str = Field(
        DEFAULT_REVISION,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_./+-]*$",
        description="Model revision (git sha, tag or version); part of the model identity.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weight dtype on the device; auto keeps the stored dtype."
    )
    name: str | None = Field(
        None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Model name served on /v2/models/{name}; defaults to the ModelDeployment name.",
    )
    endpoint: str | None = Field(
        None,
        max_length=512,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
        description=(
            "s3://: endpoint URL of an S3-compatible store (MinIO, Ceph, R2...); hf://: the Hub "
            "endpoint (default https://huggingface.co or HF_ENDPOINT)."
        ),
    )
    region: str | None = Field(
        None, max_length=64, pattern=r"^[a-z0-9-]+$", description="s3://: the bucket's region."
    )
    credentials: SecretReference | None = Field(
        None,
        description=(
            "Secret in the ModelDeployment's namespace with the storage credentials, passed to "
            "the worker as environment from secretKeyRef (never in the spec, status or logs). "
            "s3://: keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optional AWS_SESSION_TOKEN; "
            "hf://: key HF_TOKEN."
        ),
    )


PARALLELISM_MESSAGE = (
    "spec.parallelism.podsPerReplica must divide the replica's ranks (tensor x pipeline): "
    "every pod of a replica holds the same whole number of ranks"
)


class Parallelism(ApiModel):
    """A replica has tensor x pipeline ranks, spread evenly over podsPerReplica pods: ranks =
    podsPerReplica x ranks per pod, so podsPerReplica must divide tensor x pipeline (which also
    keeps it at most the rank count)."""

    model_config = _rules(
        _cel(
            # has(): the schema's default {} is checked before its inner defaults apply
            "((has(self.tensor) ? self.tensor : 1) * (has(self.pipeline) ? self.pipeline : 1)) "
            "% (has(self.podsPerReplica) ? self.podsPerReplica : 1) == 0",
            PARALLELISM_MESSAGE,
            ".podsPerReplica",
        )
    )

    tensor: int = Field(
        1,
        ge=1,
        le=limits.TENSOR_MAX,
        description="Tensor-parallel size: ranks per pipeline stage; rank r loads only its own "
        "shard. Part of the model identity.",
    )
    pipeline: int = Field(
        1,
        ge=1,
        le=limits.PIPELINE_MAX,
        description="Pipeline-parallel size: stages per replica, each of tensor ranks. A replica "
        "has tensor x pipeline ranks. Part of the model identity.",
    )
    pods_per_replica: int = Field(
        1,
        ge=1,
        le=limits.PODS_PER_REPLICA_MAX,
        description="Pods one replica spans (a LeaderWorkerSet group when more than 1); it must "
        "divide tensor x pipeline, each pod holding (tensor x pipeline) / podsPerReplica ranks, "
        "one GPU each. 1 (the default): a replica is one pod. Part of the model identity.",
    )
    max_group_restarts: int = Field(
        3,
        ge=0,
        le=limits.GROUP_RESTARTS_MAX,
        description="Times in a row a failed multi-pod replica (a LeaderWorkerSet group) is "
        "recreated; its next failure leaves it Failed, its pod and reason in the status, not "
        "recreated until the spec changes. A group that turns Ready starts over. Not part of "
        "the model identity.",
    )

    @model_validator(mode="after")
    def _ranks_divide_over_pods(self) -> Parallelism:
        # Mirrors the CEL rule, for objects that never passed the API server's admission.
        if self.ranks % self.pods_per_replica:
            raise ValueError(PARALLELISM_MESSAGE)
        return self

    @property
    def ranks(self) -> int:
        """Ranks of one replica: tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def ranks_per_pod(self) -> int:
        return self.ranks // self.pods_per_replica


class Toleration(ApiModel):
    key: LabelKey | None = Field(None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: LabelValue | None = Field(None, description="Taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, le=2**40, description="How long a NoExecute taint is tolerated."
    )


_RESERVED_ENV_RULE = " && ".join(
    f"!self.name.startsWith('{prefix}')" for prefix in limits.RESERVED_ENV_PREFIXES
)
_RESERVED_ENV_MESSAGE = (
    f"spec.template.env: names starting with {', '.join(limits.RESERVED_ENV_PREFIXES)} are "
    "reserved for the worker (its plan, bind address and the dynamic loader)"
)


class EnvVar(ApiModel):
    model_config = _rules(_cel(_RESERVED_ENV_RULE, _RESERVED_ENV_MESSAGE, ".name"))

    name: str = Field(
        min_length=1,
        max_length=limits.ENV_NAME_MAX,
        pattern=limits.ENV_NAME,
        description="Variable name; WEIGHTLIFT_* and LD_* are reserved for the worker.",
    )
    value: str = Field(
        "",
        max_length=limits.ENV_VALUE_MAX,
        pattern=limits.NO_NUL,
        description="Variable value (use a Secret-backed runtime for secrets).",
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(limits.RESERVED_ENV_PREFIXES):
            raise ValueError(_RESERVED_ENV_MESSAGE)
        return name


class Resources(ApiModel):
    requests: dict[LabelKey, Quantity] = Field(
        default_factory=dict,
        max_length=limits.RESOURCE_ITEMS,
        description="Extra resource requests (cpu, memory, ...).",
    )
    limits: dict[LabelKey, Quantity] = Field(
        default_factory=dict,
        max_length=limits.RESOURCE_ITEMS,
        description=(
            "Extra resource limits. The GPU resource (template.gpuResource) is the operator's: "
            "set from parallelism; naming it here is allowed only with that same count."
        ),
    )


DEFAULT_WORKER_IMAGE = "ghcr.io/weightlift/worker:0.1.0"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"


GPU_RESOURCE_MESSAGE = (
    "spec.template.gpuResource: an extended resource name (domain/name, e.g. nvidia.com/gpu or "
    f"nvidia.com/mig-1g.10gb), not in the {limits.NATIVE_RESOURCE_DOMAIN} domain"
)


def gpu_count_message(part: str) -> str:
    return (
        f"spec.template.resources.{part}: the GPU resource (spec.template.gpuResource) is set "
        "by the operator to the ranks a pod holds (parallelism tensor x pipeline / "
        "podsPerReplica); leave it out, or give that same count"
    )


class TemplateMetadata(ApiModel):
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        max_length=podspec.METADATA_ITEMS,
        json_schema_extra=podspec.metadata_extra("labels"),
        description="Labels of worker pods (Kueue's queue-name, your own); weightlift.dev/*, "
        "leaderworkerset.sigs.k8s.io/*, app.kubernetes.io/name and managed-by are the "
        "operator's.",
    )
    annotations: dict[
        LabelKey, Annotated[str, StringConstraints(max_length=podspec.ANNOTATION_VALUE_MAX)]
    ] = Field(
        default_factory=dict,
        max_length=podspec.METADATA_ITEMS,
        json_schema_extra=podspec.metadata_extra("annotations"),
        description="Annotations of worker pods (Multus k8s.v1.cni.cncf.io/networks, Kueue...); "
        "weightlift.dev/* and leaderworkerset.sigs.k8s.io/* are the operator's.",
    )


class WorkerPodSpec(ApiModel):
    """A PodSpec subset, in the Kubernetes API's own schema (api/kubeschema.py)."""

    model_config = _rules(*podspec.SPEC_RULES)

    affinity: podspec.Affinity | None = Field(
        None, description="Node, pod and anti-affinity of worker pods (a core/v1 Affinity)."
    )
    priority_class_name: podspec.DnsSubdomain | None = Field(
        None, description="PriorityClass of worker pods."
    )
    scheduler_name: podspec.DnsSubdomain | None = Field(
        None, description="Scheduler of worker pods (Volcano, a gang scheduler...)."
    )
    runtime_class_name: podspec.DnsSubdomain | None = Field(
        None, description="RuntimeClass of worker pods (e.g. nvidia)."
    )
    topology_spread_constraints: list[podspec.SpreadConstraint] = Field(
        default_factory=list,
        max_length=podspec.SPREAD_MAX,
        description="How worker pods spread over zones or nodes.",
    )
    image_pull_secrets: list[podspec.PullSecret] = Field(
        default_factory=list,
        max_length=podspec.PULL_SECRETS_MAX,
        description="Secrets of the registry that holds the worker and sidecar images.",
    )
    volumes: list[podspec.Volume] = Field(
        default_factory=list,
        max_length=podspec.VOLUMES_MAX,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Volumes added to worker pods, mounted by the worker container's overrides "
        f"or by sidecars. Names {', '.join(podspec.WORKER_VOLUMES)} are the operator's; "
        "hostPath is refused.",
    )
    init_containers: list[podspec.InitContainer] = Field(
        default_factory=list,
        max_length=podspec.INIT_CONTAINERS_MAX,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Init containers (restartPolicy Always: native sidecars), run before the "
        "worker.",
    )
    containers: list[podspec.Sidecar] = Field(
        default_factory=list,
        max_length=podspec.SIDECARS_MAX,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Sidecars; the container named worker is the worker container's overrides: "
        f"{', '.join(podspec.WORKER_OVERRIDES[1:])} only (command, args, image, ports and "
        "probes are the operator's).",
    )
    security_context: podspec.PodSecurityContext | None = Field(
        None,
        description="Pod security settings over the operator's (non-root uid 1000, "
        "RuntimeDefault seccomp); they may only tighten them.",
    )


WORKER_GPU_MESSAGE = (
    "spec.template.spec.containers[name=worker].resources: the GPU resource "
    "(spec.template.gpuResource) is the operator's, set from parallelism; leave it out here"
)


class PodTemplate(ApiModel):
    image: str = Field(
        DEFAULT_WORKER_IMAGE,
        min_length=1,
        max_length=limits.IMAGE_MAX,
        pattern=limits.IMAGE,
        description=(
            "Worker image. With worker InImage (the default) it contains the weightlift worker; "
            "with worker Injected it is the team's own engine image (runtime.engine vLLM or "
            "Triton)."
        ),
    )
    worker: Literal["InImage", "Injected"] = Field(
        "InImage",
        description=(
            "Where the weightlift worker comes from. InImage: the image holds it. Injected: the "
            "image is a stock vLLM image (or a Triton image with its Python backend and vLLM) "
            "with its own Python; an init container copies weightlift (pure Python, plus the "
            "compiled dependencies the image lacks, per Python ABI) into the pod and the image's "
            "Python runs it. Needs runtime.engine vLLM or Triton."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the worker container."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Resources beyond the GPUs."
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        max_length=limits.NODE_SELECTOR_ITEMS,
        description="Node labels a worker pod must match.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=limits.TOLERATION_ITEMS,
        description="Tolerations for tainted GPU nodes.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=limits.ENV_ITEMS, description="Extra worker environment."
    )
    gpu_resource: str = Field(
        DEFAULT_GPU_RESOURCE,
        max_length=limits.QUALIFIED_NAME_MAX,
        pattern=limits.EXTENDED_RESOURCE,
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(f"!self.contains('{limits.NATIVE_RESOURCE_DOMAIN}')", GPU_RESOURCE_MESSAGE)
            ]
        },
        description=(
            "Extended resource a worker pod requests its GPUs as, one per rank it holds "
            "(tensor x pipeline / podsPerReplica): nvidia.com/gpu, a MIG profile such as "
            "nvidia.com/mig-1g.10gb, or another vendor's (amd.com/gpu). The tensor-parallel "
            "check counts the nodes' allocatable of this name."
        ),
    )
    rdma_resource: str | None = Field(
        None,
        max_length=limits.QUALIFIED_NAME_MAX,
        pattern=r"^[a-z0-9.-]+/[a-z0-9_.-]+$",
        description="Extended resource for RDMA NICs (e.g. rdma/ib); one is requested per pod.",
    )
    rdma_resources: list[
        Annotated[
            str,
            StringConstraints(
                max_length=limits.QUALIFIED_NAME_MAX, pattern=r"^[a-z0-9.-]+/[a-z0-9_.-]+$"
            ),
        ]
    ] = Field(
        default_factory=list,
        max_length=8,
        description="More RDMA extended resources (one per NIC rail, e.g. rdma/rail0, rdma/rail1); "
        "one of each is requested per pod, with rdmaResource.",
    )
    shm_size: str = Field(
        "8Gi",
        max_length=32,
        pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$",
        description="Size limit of the /dev/shm memory volume.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=limits.DNS_SUBDOMAIN_MAX,
        pattern=limits.DNS_SUBDOMAIN,
        description=(
            "ServiceAccount of worker pods. Unset: the namespace's default account with no API "
            "token mounted (workers need no API access). The chart's weightlift-worker account "
            "may read its ModelDeployment."
        ),
    )

    metadata: TemplateMetadata | None = Field(
        None, description="Labels and annotations of worker pods, merged under the operator's."
    )
    spec: WorkerPodSpec | None = Field(
        None,
        description="More of the worker pod's PodSpec: affinity, priority and scheduler, "
        "pull secrets, volumes, sidecars and init containers, the worker container's "
        "overrides (a container named worker) and pod security.",
    )

    @model_validator(mode="after")
    def _operator_fields_refused(self) -> PodTemplate:
        # Mirrors the CEL rules (podspec.py), for objects that never passed admission.
        errors = podspec.template_errors(
            self.metadata.wire() if self.metadata else None,
            self.spec.wire() if self.spec else None,
        )
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @field_validator("gpu_resource")
    @classmethod
    def _extended(cls, name: str) -> str:
        # Mirrors the CEL rule, for objects that never passed the API server's admission.
        if limits.NATIVE_RESOURCE_DOMAIN in name:
            raise ValueError(GPU_RESOURCE_MESSAGE)
        return name


class PreloadOptions(ApiModel):
    threads: int | None = Field(
        None,
        ge=1,
        le=128,
        description="Parallel file readers (unset: the pod's CPU limit, at least 4, at most 64).",
    )
    chunk_mib: int = Field(64, ge=1, le=4096, description="Read and copy chunk size in MiB.")
    host_memory_fraction: float = Field(
        0.8,
        ge=0.05,
        le=1.0,
        description="Auto preloads when the shard fits in this fraction of available host memory.",
    )
    pinned: bool = Field(True, description="Use pinned host memory when the device is CUDA.")


# auto: dev64 where the weights are on a GPU, else xxh3 (worker/p2p/manifest.resolve_kind).
ChecksumSetting = Literal["auto", "xxh3", "crc32", "dev64"]


class PeerToPeerOptions(ApiModel):
    backend: Literal["UCX"] = Field("UCX", description="NIXL backend plugin.")
    transfer_timeout_seconds: int = Field(
        30, ge=1, le=3600, description="Deadline of one batch of READs before the peer is dropped."
    )
    max_in_flight: int = Field(8, ge=1, le=256, description="Transfer requests in flight.")
    checksum: ChecksumSetting = Field(
        "auto",
        description=(
            "Per-tensor checksum the source publishes and the target verifies before serving. "
            "dev64: computed on the device holding the bytes (a GPU kernel, no host copy; the "
            "same digest on CPU). auto: dev64 where the weights are on a GPU, else xxh3."
        ),
    )


class NodeCache(ApiModel):
    enabled: bool = Field(
        False,
        description=(
            "Keep s3:// and hf:// downloads in a directory on the node; a replica that finds "
            "its model identity there (verified by size and digest) skips storage."
        ),
    )
    path: str = Field(
        "/var/cache/weightlift",
        pattern=r"^/[^\s]*$",
        max_length=1024,
        description="Node directory of the cache (a hostPath volume).",
    )
    max_size_gib: int = Field(
        100,
        ge=1,
        le=1 << 20,
        alias="maxSizeGiB",
        description="Least recently used entries are evicted to keep the cache under this size.",
    )


class LoadingSpec(ApiModel):
    strategy: LoadStrategy = Field(
        LoadStrategy.AUTO,
        description=(
            "Auto: peer-to-peer when a Ready source exists, else Preload if host memory "
            "allows, else Direct. PeerToPeer, Preload or Direct force one strategy."
        ),
    )
    initial_sources: int = Field(
        1, ge=1, le=64, description="Replicas that load from storage when no source is Ready."
    )
    wait_for_source_seconds: int = Field(
        300,
        ge=0,
        le=86400,
        description="How long other replicas wait for a Ready source before loading from storage.",
    )
    load_timeout_seconds: int = Field(
        1800, ge=10, le=86400, description="A replica not loaded by then is marked failed."
    )
    preload: PreloadOptions = Field(
        default_factory=PreloadOptions, description="CPU preload options."
    )
    peer_to_peer: PeerToPeerOptions = Field(
        default_factory=PeerToPeerOptions, description="Peer-to-peer (NIXL) options."
    )
    cache: NodeCache = Field(
        default_factory=NodeCache, description="Node-local cache of downloaded models."
    )


_LIBRARY_MESSAGE = (
    "spec.initHooks.library: a path relative to the model dir without '..' segments; an "
    "absolute path needs spec.initHooks.allowOutsideModelDir"
)


class InitHooks(ApiModel):
    model_config = _rules(
        _cel(
            "(has(self.allowOutsideModelDir) && self.allowOutsideModelDir) || "
            f"(!self.library.startsWith('/') && !self.library.matches(r'{_DOTDOT_SEGMENT}'))",
            _LIBRARY_MESSAGE,
            ".library",
        )
    )

    library: str = Field(
        min_length=1,
        max_length=1024,
        pattern=limits.NO_NUL,
        description=(
            "Shared library dlopen'd before the model loads; triton_pytorch_model_init(model_dir, "
            "device_index) is called per device. Relative paths resolve inside the model dir."
        ),
    )
    required: bool = Field(
        True, description="Fail the load when the library or its init symbol is missing."
    )
    allow_outside_model_dir: bool = Field(
        False,
        description="Allow an absolute library path outside the model dir (trusted images only).",
    )


# Fields only an External runtime's own server gives meaning to: the worker's paths are fixed.
EXTERNAL_ONLY_FIELDS = ("protocol", "readiness_path", "liveness_path", "startup_seconds")
# How long an External server may take to answer its liveness path before the kubelet's liveness
# probe counts: a stock vLLM or tritonserver opens its port only once the weights are loaded.
DEFAULT_STARTUP_SECONDS = 1800


def external_only_message(field: str) -> str:
    return (
        f"spec.runtime.{to_camel(field)} applies to runtime.type External (the Builtin worker "
        "serves /v2/health/ready and /v2/health/live)"
    )


class RuntimeSpec(ApiModel):
    model_config = _rules(
        *(
            _cel(
                f"(has(self.type) && self.type == 'External') || !has(self.{to_camel(name)})",
                external_only_message(name),
                f".{to_camel(name)}",
            )
            for name in EXTERNAL_ONLY_FIELDS
        )
    )

    type: RuntimeType = Field(
        RuntimeType.BUILTIN,
        description="Builtin: the worker serves model.pt2 over KServe v2. External: the "
        "container runs command, a server that speaks runtime.protocol on port.",
    )
    port: int = Field(
        8000,
        ge=1024,
        le=65535,
        description="HTTP port of the pod's server: the worker's, or an External runtime's own "
        "(vllm serve and tritonserver default to 8000 too). The kubelet's health probes and the "
        "operator's inference probe use it.",
    )
    command: list[Arg] = Field(
        default_factory=list,
        max_length=limits.COMMAND_ITEMS,
        description="External runtime command (e.g. tritonserver ...); required for External.",
    )
    protocol: ServingProtocol | None = Field(
        None,
        description="type External: the HTTP API its server speaks, which picks the kubelet's "
        "health paths and the operator's inference probe. KServeV2 (when unset): "
        "/v2/health/ready and /v2/health/live; probed with KServe v2 /v2/models/{model}/infer, "
        "or probe.completion. Triton (tritonserver): the same paths; a probe.completion uses "
        "Triton's generate extension (/v2/models/{model}/generate). OpenAI (vllm serve): GET "
        "/health for both; needs probe.completion, sent to /v1/completions.",
    )
    readiness_path: HttpPath | None = Field(
        None,
        description="type External: path of the kubelet's readiness probe (HTTP GET on port), "
        "instead of the protocol's (/v2/health/ready; OpenAI: /health).",
    )
    liveness_path: HttpPath | None = Field(
        None,
        description="type External: path of the kubelet's liveness probe (HTTP GET on port), "
        "instead of the protocol's (/v2/health/live; OpenAI: /health).",
    )
    startup_seconds: int | None = Field(
        None,
        ge=10,
        le=86400,
        description="type External: how long the server may take to first answer its liveness "
        f"path (a startupProbe; liveness counts only after it). Unset: {DEFAULT_STARTUP_SECONDS}"
        " s: a stock vLLM or tritonserver opens its port only once its weights are loaded.",
    )
    engine: Engine = Field(
        Engine.BUILTIN,
        description=(
            "With type Builtin, what serves the model. Builtin: the worker serves model.pt2 over "
            "KServe v2. vLLM: the worker runs vLLM's OpenAI server on enginePort with weightlift "
            "loading (--load-format weightlift: peer-to-peer or preload, checksums verified, then "
            "the replica is a P2P source); needs model.format safetensors. Triton: the worker "
            "runs tritonserver (HTTP on enginePort, gRPC on engineGrpcPort, metrics on "
            "engineMetricsPort) with a Python-backend model that runs vLLM with the same "
            "weightlift loading, answering Triton's generate extension; needs model.format "
            "safetensors."
        ),
    )
    engine_port: int = Field(
        8001,
        ge=1024,
        le=65535,
        description="Port of the engine's own server (vLLM: the OpenAI API under /v1), on the "
        "pod's loopback with a key only the worker holds: clients use the worker's /v1 on "
        "`port`, open once the replica is Ready.",
    )
    engine_grpc_port: int = Field(
        8003, ge=1024, le=65535, description="Triton's gRPC port (runtime.engine Triton)."
    )
    engine_metrics_port: int = Field(
        8002, ge=1024, le=65535, description="Triton's metrics port (runtime.engine Triton)."
    )
    engine_args: list[Arg] = Field(
        default_factory=list,
        max_length=limits.COMMAND_ITEMS,
        description="Extra engine command-line arguments, one list item per argument "
        "(e.g. [--max-model-len, '4096']); the tensor-parallel size comes from parallelism.",
    )

    @model_validator(mode="after")
    def _external_needs_command(self) -> RuntimeSpec:
        if self.type == RuntimeType.EXTERNAL and not self.command:
            raise ValueError("runtime.command is required when runtime.type is External")
        for name in EXTERNAL_ONLY_FIELDS:
            # Mirrors the CEL rules above, for objects that never passed admission.
            if self.type != RuntimeType.EXTERNAL and getattr(self, name) is not None:
                raise ValueError(external_only_message(name))
        if self.type == RuntimeType.EXTERNAL and self.engine != Engine.BUILTIN:
            raise ValueError("runtime.engine applies to runtime.type Builtin, not External")
        if self.engine != Engine.BUILTIN and self.engine_port == self.port:
            raise ValueError("runtime.enginePort must differ from runtime.port")
        triton_ports = [
            self.port,
            self.engine_port,
            self.engine_grpc_port,
            self.engine_metrics_port,
        ]
        if self.engine == Engine.TRITON and len(set(triton_ports)) != len(triton_ports):
            raise ValueError(
                "runtime.port, enginePort, engineGrpcPort and engineMetricsPort must differ "
                "with runtime.engine Triton"
            )
        return self

    @property
    def endpoints(self) -> ProtocolEndpoints:
        """What the pod's server answers: an External runtime's protocol's (KServeV2 unset);
        the worker's front door speaks KServe v2."""
        protocol = ServingProtocol.KSERVE_V2
        if self.type == RuntimeType.EXTERNAL and self.protocol is not None:
            protocol = ServingProtocol(self.protocol)
        return PROTOCOL_ENDPOINTS[protocol]

    @property
    def health_paths(self) -> tuple[str, str]:
        """The kubelet's (readiness, liveness) paths: the spec's, else the protocol's."""
        endpoints = self.endpoints
        return (
            self.readiness_path or endpoints.readiness_path,
            self.liveness_path or endpoints.liveness_path,
        )


def pulls_from_peers(loading: LoadingSpec, runtime: RuntimeSpec) -> bool:
    """Whether a Target replica may pull its weights from a peer: the strategy allows it (Auto,
    PeerToPeer) and the worker loads the weights (an External runtime loads its own). The
    operator asks this to decide whether waiting for a source helps; the worker asks it before
    it tries a peer. One rule, so the two never disagree."""
    strategies = (LoadStrategy.AUTO, LoadStrategy.PEER_TO_PEER)
    return LoadStrategy(loading.strategy) in strategies and runtime.type != RuntimeType.EXTERNAL


INJECTED_WORKER_MESSAGE = (
    "spec.template.worker Injected needs spec.runtime.type Builtin with spec.runtime.engine vLLM "
    "or Triton"
)
# A spare waits in Standby for its hand-off: only a Target that may pull from peers does.
WARM_SPARES_MESSAGE = (
    "spec.warmSpares needs spec.loading.strategy Auto or PeerToPeer and spec.runtime.type "
    "Builtin (a spare waits in Standby to be handed peers)"
)


# A spare is one pod relabelled into service; a group's pods share one LeaderWorkerSet template
# and count, so no group can be held aside or woken alone.
GROUP_SPARES_MESSAGE = (
    "spec.warmSpares needs spec.parallelism.podsPerReplica 1: a warm spare is one pod woken by "
    "relabelling it, and a LeaderWorkerSet group's pods cannot be held aside or woken alone"
)


class ExpectedTensor(ApiModel):
    name: str = Field(
        min_length=1,
        max_length=limits.NAME_MAX,
        pattern=limits.NO_NUL,
        description="Output tensor name.",
    )
    shape: list[Annotated[int, Field(ge=-1, le=2**31)]] | None = Field(
        None, max_length=limits.SHAPE_DIMS, description="Expected shape; omitted means any."
    )
    data: list[float] = Field(
        default_factory=list,
        max_length=limits.EXPECTED_VALUES,
        description="Expected values, flattened row-major.",
    )


_TENSOR_NAME: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": limits.NAME_MAX,
    "description": "Tensor name.",
}
# The CRD schema of probe.request: a KServe v2 inference request typed all the way down, so
# that its size and depth are bounded at admission (a free-form request once nested deep enough
# to drive a JSON decoder into RecursionError). Tensor data are numbers: the API server's CEL
# cannot check values of mixed type, and text probes use probe.completion instead.
KSERVE_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "KServe v2 inference request body POSTed to /v2/models/{model}/infer.",
    "properties": {
        "id": {"type": "string", "maxLength": limits.NAME_MAX, "description": "Request id."},
        "inputs": {
            "type": "array",
            "description": "Input tensors.",
            "maxItems": limits.REQUEST_ITEMS,
            "items": {
                "type": "object",
                "description": "One input tensor.",
                "required": ["name", "datatype", "shape", "data"],
                "properties": {
                    "name": _TENSOR_NAME,
                    "datatype": {
                        "type": "string",
                        "maxLength": 16,
                        "pattern": "^[A-Z0-9]+$",
                        "description": "KServe v2 datatype (FP32, INT64, ...).",
                    },
                    "shape": {
                        "type": "array",
                        "description": "Tensor shape.",
                        "maxItems": limits.SHAPE_DIMS,
                        "items": {"type": "integer", "minimum": 0, "maximum": 2**31},
                    },
                    "data": {
                        "type": "array",
                        "description": "Tensor contents as numbers, flattened row-major.",
                        "maxItems": limits.REQUEST_VALUES,
                        "items": {"type": "number"},
                    },
                },
            },
        },
        "outputs": {
            "type": "array",
            "description": "Requested outputs.",
            "maxItems": limits.REQUEST_ITEMS,
            "items": {
                "type": "object",
                "description": "One requested output.",
                "required": ["name"],
                "properties": {"name": _TENSOR_NAME},
            },
        },
    },
}


class CompletionProbe(ApiModel):
    # No default of its own: unset, the runtime's protocol picks it (inference_call).
    protocol: CompletionProtocol | None = Field(
        None,
        description="OpenAI: POST /v1/completions (vLLM, SGLang). TritonGenerate: POST "
        "/v2/models/{model}/generate (text_input -> text_output). Unset: TritonGenerate with "
        "runtime.protocol Triton, else OpenAI.",
    )
    prompt: str = Field(min_length=1, max_length=8192, description="Prompt text.")
    max_tokens: int = Field(16, ge=1, le=4096, description="Tokens to generate (greedy).")
    expected_text: str | None = Field(
        None, max_length=65536, description="The generated text must equal this exactly."
    )
    expected_prefix: str | None = Field(
        None, min_length=1, max_length=65536, description="The generated text must start so."
    )

    @model_validator(mode="after")
    def _one_expectation(self) -> CompletionProbe:
        if (self.expected_text is None) == (self.expected_prefix is None):
            raise ValueError("a completion probe needs exactly one of expectedText, expectedPrefix")
        return self


class InferenceProbe(ApiModel):
    request: Annotated[dict[str, Any], WithJsonSchema(KSERVE_REQUEST_SCHEMA)] | None = Field(
        None,
        description="KServe v2 inference request body POSTed to /v2/models/{model}/infer; "
        "omitted (and no completion): zeros shaped like the model's declared inputs.",
    )
    completion: CompletionProbe | None = Field(
        None,
        description="A greedy (temperature 0) text generation whose output must match; "
        "replaces the KServe v2 request for LLM engines.",
    )
    expected_outputs: list[ExpectedTensor] = Field(
        default_factory=list,
        max_length=limits.EXPECTED_OUTPUTS,
        description="Expected outputs; empty checks names, shapes and datatypes only.",
    )
    tolerance: float = Field(
        1e-4, ge=0, le=1e30, description="Absolute tolerance when comparing output values."
    )
    period_seconds: int = Field(10, ge=1, le=3600, description="Seconds between probes.")
    timeout_seconds: int = Field(5, ge=1, le=600, description="Timeout of one probe request.")
    failure_threshold: int = Field(
        3, ge=1, le=100, description="Consecutive failures before a replica is not Ready."
    )

    @field_validator("request")
    @classmethod
    def _bounded_request(cls, request: dict[str, Any] | None) -> dict[str, Any] | None:
        if request is None:
            return None
        depth = limits.json_depth(request, limits.REQUEST_MAX_DEPTH)
        if depth > limits.REQUEST_MAX_DEPTH:
            raise ValueError(
                f"spec.probe.request: nested deeper than {limits.REQUEST_MAX_DEPTH} levels"
            )
        size = len(json.dumps(request))
        if size > limits.REQUEST_MAX_BYTES:
            raise ValueError(
                f"spec.probe.request: {size} bytes of JSON; at most {limits.REQUEST_MAX_BYTES}"
            )
        return request


def inference_call(runtime: RuntimeSpec, probe: InferenceProbe | None) -> CompletionProtocol | None:
    """What the operator's inference probe sends: a completion over the returned protocol (the
    probe's own, else the runtime protocol's default), or None: a KServe v2 /infer request.
    The one place this is decided; admission keeps it to what the runtime answers."""
    if probe is None or probe.completion is None:
        return None
    if probe.completion.protocol is not None:
        return CompletionProtocol(probe.completion.protocol)
    return runtime.endpoints.completions[0]


def _protocol_names(protocols: Iterable[StrEnum]) -> str:
    return " or ".join(str(p) for p in protocols)


# An External runtime's protocol and the probe: admission (CEL in crd.py, pydantic below) keeps
# the operator's probe to what the server answers, as PROTOCOL_ENDPOINTS says.
PROBE_NEEDS_COMPLETION_MESSAGE = (
    "spec.probe.completion is required with spec.runtime.protocol "
    + _protocol_names(p for p, e in PROTOCOL_ENDPOINTS.items() if not e.infer)
    + ": the server answers no KServe v2 /infer, so the operator probes it with a completion"
)
COMPLETION_PROTOCOL_MESSAGE = (
    "spec.probe.completion.protocol must be one spec.runtime.protocol's server answers ("
    + "; ".join(f"{p}: {_protocol_names(e.completions)}" for p, e in PROTOCOL_ENDPOINTS.items())
    + ")"
)


class Rollout(ApiModel):
    max_surge: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Extra replicas allowed while rolling to a new model identity or pod template "
            "(spec.template, runtime, initHooks)."
        ),
    )


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class ServiceSpec(ApiModel):
    enabled: bool = Field(
        True,
        description="Create a Service named after the ModelDeployment (owned by it) that "
        "selects its serving replicas only: never warm spares, targets still waiting for "
        "their weights, or retired revisions. Worker pods carry the readiness gate "
        "weightlift.dev/inference-probe, so an endpoint is ready only once its replica passed "
        "the inference probe.",
    )
    type: ServiceType = Field(
        ServiceType.CLUSTER_IP,
        description="The Service's type: ClusterIP, NodePort or LoadBalancer.",
    )
    port: int = Field(
        80,
        ge=1,
        le=65535,
        description="The Service's port (named http) for the worker's HTTP API (KServe v2, "
        "OpenAI /v1); it targets runtime.port. With runtime.engine Triton, Triton's HTTP and "
        "gRPC ports are exposed too, on their own numbers.",
    )


class ModelDeploymentSpec(ApiModel):
    model: ModelSource = Field(description="The model to load and serve.")
    replicas: int = Field(1, ge=0, le=1024, description="Number of model replicas.")
    warm_spares: int = Field(
        0,
        ge=0,
        le=limits.WARM_SPARES_MAX,
        description=(
            "Pods kept beyond replicas, started up to their weight step and waiting in Standby. "
            "A scale-up, from zero too, first hands spares their peers (or storage when no "
            "source is Ready), so they serve in seconds; new spares then take their place. Each "
            "spare holds a GPU pod (parallelism.tensor GPUs) while it waits. Spares are never "
            "Ready and stay out of status.replicas and the scale subresource's selector (an "
            "HPA counts serving replicas only). Needs loading.strategy Auto or PeerToPeer and "
            "runtime.type Builtin."
        ),
    )
    parallelism: Parallelism = Field(
        default_factory=Parallelism,
        description="Parallelism within one replica: its ranks (tensor x pipeline) and the pods "
        "they spread over (podsPerReplica ranks each). All three are part of the model identity.",
    )
    template: PodTemplate = Field(default_factory=PodTemplate, description="Worker pod settings.")
    loading: LoadingSpec = Field(
        default_factory=LoadingSpec, description="How weights reach the GPUs."
    )
    init_hooks: InitHooks | None = Field(
        None, description="Library whose init hook runs before the model package loads."
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Serving runtime.")
    probe: InferenceProbe | None = Field(
        None,
        description="Inference probe; a replica counts as Ready only after it passes.",
    )
    rollout: Rollout = Field(default_factory=Rollout, description="Rollover between identities.")
    service: ServiceSpec = Field(
        default_factory=ServiceSpec,
        description="The Service in front of the serving replicas (on by default).",
    )

    @model_validator(mode="after")
    def _format_fits_runtime(self) -> ModelDeploymentSpec:
        # Mirrors the CRD's CEL rules, for objects that never passed the API server's admission.
        vllm = self.runtime.type == RuntimeType.BUILTIN and self.runtime.engine in (
            Engine.VLLM,
            Engine.TRITON,
        )
        if (
            self.model.format == ModelFormat.SAFETENSORS
            and self.runtime.type != RuntimeType.EXTERNAL
            and not vllm
        ):
            raise ValueError(
                "spec.model.format safetensors needs spec.runtime.engine vLLM or Triton, or "
                "spec.runtime.type External (the Builtin engine serves pt2 programs)"
            )
        if vllm and self.model.format != ModelFormat.SAFETENSORS:
            raise ValueError(
                f"spec.runtime.engine {self.runtime.engine} needs spec.model.format safetensors"
            )
        if self.warm_spares and not pulls_from_peers(self.loading, self.runtime):
            raise ValueError(WARM_SPARES_MESSAGE)
        if self.template.worker == "Injected" and not (
            self.runtime.type == RuntimeType.BUILTIN
            and self.runtime.engine in (Engine.VLLM, Engine.TRITON)
        ):
            raise ValueError(INJECTED_WORKER_MESSAGE)
        return self

    @model_validator(mode="after")
    def _gpus_are_the_operators(self) -> ModelDeploymentSpec:
        # Mirrors the CRD's CEL rules, for objects that never passed the API server's admission.
        gpu, count = self.template.gpu_resource, str(self.parallelism.ranks_per_pod)
        for part, values in (
            ("limits", self.template.resources.limits),
            ("requests", self.template.resources.requests),
        ):
            if gpu in values and values[gpu] != count:
                raise ValueError(gpu_count_message(part))
        for c in self.template.spec.containers if self.template.spec else ():
            resources = c.get("resources") or {}
            if c.get("name") == podspec.WORKER_CONTAINER and any(
                gpu in (resources.get(part) or {}) for part in ("limits", "requests")
            ):
                raise ValueError(WORKER_GPU_MESSAGE)
        return self

    @model_validator(mode="after")
    def _probe_fits_protocol(self) -> ModelDeploymentSpec:
        # Mirrors the CRD's CEL rules, for objects that never passed the API server's admission.
        endpoints = self.runtime.endpoints
        call = inference_call(self.runtime, self.probe)
        if call is None and not endpoints.infer:
            raise ValueError(PROBE_NEEDS_COMPLETION_MESSAGE)
        if call is not None and call not in endpoints.completions:
            raise ValueError(COMPLETION_PROTOCOL_MESSAGE)
        return self


# --------------------------------------------------------------------------------- status


class Phase(StrEnum):
    PENDING = "Pending"
    WAITING_FOR_SOURCE = "WaitingForSource"
    LOADING = "Loading"
    PROBING = "Probing"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    SCHEDULED = "Scheduled"
    WEIGHTS_LOADED = "WeightsLoaded"
    INFERENCE_READY = "InferenceReady"
    READY = "Ready"


class Condition(ApiModel):
    type: str = Field(description="Scheduled, WeightsLoaded, InferenceReady or Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="Condition status.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field("", description="Human readable detail.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time of last change.")


class ProbeResult(ApiModel):
    passed: bool = Field(description="Whether the last inference probe passed.")
    message: str = Field("", description="Why it failed, or a summary of the output.")
    consecutive_failures: int = Field(0, ge=0, description="Failures in a row.")
    last_probe_time: str | None = Field(None, description="RFC 3339 time of the last probe.")
    latency_ms: float | None = Field(None, description="Latency of the last probe request.")


class RankTransport(ApiModel):
    """How one rank's weights moved from its peer, as UCX itself named it."""

    rank: int = Field(ge=0, description="Rank (tensor x pipeline index).")
    transport: str = Field(
        description="The transport and protocol UCX chose for this rank's peer READs, in its own "
        "words: cma/memory (zero-copy) between processes of one host, cuda_ipc/cuda (zero-copy) "
        "between GPUs of one node, rc_mlx5/mlx5_0:1 (zero-copy) over RDMA, tcp/lo (software "
        "emulation) when nothing faster carries this memory; unknown (...) when UCX recorded none."
    )
    note: str = Field(
        "",
        description="Why the rank gave the peer up for storage (UCX moved GPU memory only by "
        "software emulation, slower than loading from storage) or pulled on regardless.",
    )


class GroupPodStatus(ApiModel):
    """One pod of a multi-pod replica (a LeaderWorkerSet group): its ranks and their load."""

    name: str = Field(description="Pod name.")
    index: int = Field(ge=0, description="Index in the group (0: the leader).")
    ranks: list[int] = Field(default_factory=list, description="Ranks this pod holds.")
    phase: str = Field(description="The pod's worker phase (as a replica's).")
    pod_ip: str | None = Field(None, alias="podIP", description="Pod IP.")
    loaded_from: str | None = Field(
        None, description="storage:<scheme> or peer:<pod> (the same-index pod of a source group)."
    )
    bytes_loaded: int = Field(0, ge=0, description="Bytes of this pod's shard on its device.")
    bytes_total: int = Field(0, ge=0, description="Bytes of this pod's shard.")
    message: str = Field("", description="Detail, e.g. why the pod failed.")


class ReplicaStatus(ApiModel):
    name: str = Field(description="Worker pod name (a group's leader pod).")
    replica: int = Field(ge=0, description="Replica index.")
    model_identity: str = Field(description="Identity of the weights this replica loads.")
    role: Role = Field(description="Source (from storage) or Target (from a peer).")
    phase: str = Field(
        description="Pending, Scheduled, InitHooks, Standby, Spare (a warm spare in Standby), "
        "Loading, Serving, Ready, Failed."
    )
    spare: bool | None = Field(
        None,
        description="True for a warm spare (spec.warmSpares): waiting beyond spec.replicas, "
        "not serving, not in status.replicas.",
    )
    node: str | None = Field(None, description="Node the pod is bound to.")
    pod_ip: str | None = Field(None, alias="podIP", description="Pod IP.")
    loaded_from: str | None = Field(
        None,
        description="storage:<scheme> (s3, hf, pvc, hostpath, file), cache (node-local) or "
        "peer:<pod>.",
    )
    bytes_loaded: int = Field(0, ge=0, description="Weight bytes on the device so far.")
    bytes_total: int = Field(0, ge=0, description="Weight bytes this replica loads.")
    gbps: float | None = Field(None, description="Load throughput in GB/s.")
    load_seconds: float | None = Field(None, description="Seconds spent loading weights.")
    compile_cache: str | None = Field(
        None,
        description="The engine's compiled program: hit (peer) (shipped from a Ready source), "
        "hit (store) (from a store that outlived replicas), miss (<reason>) (compiled) or none "
        "(no compilation).",
    )
    hooks_run: bool | None = Field(None, description="Whether init hooks ran.")
    transports: list[RankTransport] | None = Field(
        None,
        max_length=limits.TENSOR_MAX * limits.PIPELINE_MAX,
        description="Per rank that pulled (or tried to) from a peer: the transport UCX used.",
    )
    engine_ports: dict[str, int] | None = Field(
        None, description="The engine's own ports by protocol (Triton: http, grpc, metrics)."
    )
    ready: bool = Field(False, description="Passed its inference probe.")
    probe: ProbeResult | None = Field(None, description="Last inference probe result.")
    message: str = Field("", description="Detail, e.g. why the replica failed.")
    pods: list[GroupPodStatus] | None = Field(
        None,
        max_length=limits.PODS_PER_REPLICA_MAX,
        description="A multi-pod replica's pods (spec.parallelism.podsPerReplica > 1), leader "
        "first: per-rank load progress and source. The replica is Ready once its leader's probe, "
        "computed across every pod of the group, passes.",
    )


class SourceEndpoint(ApiModel):
    pod: str = Field(description="Pod holding the weights.")
    deployment: str = Field(description="ModelDeployment the pod belongs to.")
    address: str = Field(description="host:port of the worker's HTTP endpoint.")
    model_identity: str = Field(description="Identity of the weights it serves.")
    ranks: list[int] = Field(default_factory=list, description="Tensor-parallel ranks served.")


class ServiceStatus(ApiModel):
    name: str = Field(description="The Service selecting this deployment's serving replicas.")
    type: ServiceType = Field(description="ClusterIP, NodePort or LoadBalancer.")
    ports: str = Field(
        description="Its ports as name:port/protocol, comma-separated (kubectl get svc's form)."
    )


class ModelDeploymentStatus(ApiModel):
    # Written by this operator; tolerate fields a newer/older operator wrote.
    model_config = ConfigDict(extra="ignore")

    phase: Phase = Field(Phase.PENDING, description="Lifecycle phase.")
    message: str = Field("", description="Why the phase is what it is.")
    observed_generation: int | None = Field(None, description="Generation last reconciled.")
    model_identity: str | None = Field(
        None, description="Hash of uri, revision, format, dtype and TP layout."
    )
    replicas: int = Field(
        0, ge=0, description="Serving worker pods that exist (warm spares not counted)."
    )
    ready_replicas: int = Field(0, ge=0, description="Replicas that passed inference probes.")
    updated_replicas: int = Field(0, ge=0, description="Ready replicas of the current identity.")
    ready: str = Field("0/0", description="ready/desired, for kubectl get.")
    ready_sources: int = Field(0, ge=0, description="Ready sources of the current identity.")
    standby: int = Field(
        0,
        ge=0,
        description="Targets started and waiting in Standby to be handed peers (spares apart).",
    )
    spares: int = Field(
        0,
        ge=0,
        description="Warm spares waiting in Standby, ready to serve on a scale-up "
        "(spec.warmSpares wants this many); never Ready, not in replicas.",
    )
    loaded: str = Field("0%", description="Percent of weight bytes loaded, for kubectl get.")
    selector: str = Field(
        "",
        description="Label selector of serving worker pods, spares left out (scale subresource).",
    )
    waiting_since: str | None = Field(
        None, description="When replicas started waiting for a source (RFC 3339)."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    restarts: int = Field(
        0, ge=0, description="Failed replicas replaced since the deployment was last Ready."
    )
    group_restarts: dict[str, int] | None = Field(
        None,
        description="Per multi-pod replica (by leader pod): times in a row its group failed and "
        "was recreated, since it was last Ready or the spec changed "
        "(spec.parallelism.maxGroupRestarts bounds it).",
    )
    sources: list[SourceEndpoint] = Field(
        default_factory=list, description="Ready replicas other replicas can pull weights from."
    )
    replica_statuses: list[ReplicaStatus] = Field(
        default_factory=list, description="One entry per worker pod."
    )
    service: ServiceStatus | None = Field(
        None, description="The Service in front of the serving replicas (spec.service)."
    )
