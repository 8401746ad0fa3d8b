"""The worker's plan: everything the operator tells one worker process.

The contract between operator and worker: the operator builds the plan, the worker reports back.
The plan travels in two parts (see operator/shared_objects.py for why): the large part every
replica of a ModelDeployment revision shares (`SharedPlan`: model, loading, hooks, runtime,
probe) as a file from a ConfigMap, checked against the sha256 the pod carries in
WEIGHTLIFT_PLAN_SHA256; and the small per-replica `Assignment` (pod, role, peers, model dir) as
JSON in WEIGHTLIFT_ASSIGNMENT.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from pathlib import Path

from pydantic import Field

from weightlift.api.model import (
    ApiModel,
    InferenceProbe,
    InitHooks,
    LoadingSpec,
    LoadStrategy,
    ModelSource,
    RankTransport,
    Role,
    RuntimeSpec,
)

# The shared plan's file (the ConfigMap's key, mounted), its sha256 and the ConfigMap's name.
PLAN_FILE_ENV = "WEIGHTLIFT_PLAN_FILE"
PLAN_SHA256_ENV = "WEIGHTLIFT_PLAN_SHA256"
PLAN_CONFIGMAP_ENV = "WEIGHTLIFT_PLAN_CONFIGMAP"
PLAN_KEY = "plan.json"
ASSIGNMENT_ENV = "WEIGHTLIFT_ASSIGNMENT"
# The P2P token of the model identity (a Secret's key, as env): targets send it, sources check it.
PEER_TOKEN_ENV = "WEIGHTLIFT_PEER_TOKEN"
# The most bytes of engine compile cache a target fetches from a source (the chart's
# compileCacheMaxBytes through the operator); a bigger cache is not fetched: the target compiles.
COMPILE_CACHE_MAX_BYTES_ENV = "WEIGHTLIFT_COMPILE_CACHE_MAX_BYTES"
# The node's compile-cache store (the chart's compileStore, a hostPath at the same path in the
# pod; "" or unset: none) and its bound in bytes (compileStoreMaxBytes): a replica with no Ready
# peer installs a verified entry from it before its engine compiles; a Ready one stores its own.
COMPILE_STORE_ENV = "WEIGHTLIFT_COMPILE_STORE"
COMPILE_STORE_MAX_BYTES_ENV = "WEIGHTLIFT_COMPILE_STORE_MAX_BYTES"
DEFAULT_COMPILE_STORE = "/var/cache/weightlift/compile-store"
# The cluster's compile-cache store by URI (s3://bucket/prefix; "" or unset: none), for replicas
# on every node; its S3 endpoint, and its credentials from a Secret (secretKeyRef env, never a
# value the operator reads), named apart from the model's own AWS_* credentials.
COMPILE_STORE_URI_ENV = "WEIGHTLIFT_COMPILE_STORE_URI"
# A cluster store on a ReadWriteMany claim (pvc://claim/path): the directory it is mounted at.
COMPILE_STORE_SHARED_ENV = "WEIGHTLIFT_COMPILE_STORE_SHARED"
COMPILE_STORE_S3_ENDPOINT_ENV = "WEIGHTLIFT_COMPILE_STORE_S3_ENDPOINT"
COMPILE_STORE_ACCESS_KEY_ENV = "WEIGHTLIFT_COMPILE_STORE_AWS_ACCESS_KEY_ID"
COMPILE_STORE_SECRET_KEY_ENV = "WEIGHTLIFT_COMPILE_STORE_AWS_SECRET_ACCESS_KEY"
DEFAULT_COMPILE_STORE_MAX_BYTES = 4 << 30
PEER_TOKEN_KEY = "token"
# A Target's hand-off file: the pod's weightlift.dev/peers annotation (a PeerHandoff as JSON),
# projected by a downwardAPI volume, which the kubelet rewrites in place when it changes.
PEERS_FILE_ENV = "WEIGHTLIFT_PEERS_FILE"
PEERS_FILE = "peers.json"
# A pod of a multi-pod replica (a LeaderWorkerSet group, spec.parallelism.podsPerReplica > 1):
# LWS's pod webhook gives it its index in the group and the group's size as env; the group's
# torch.distributed rendezvous listens on the leader's GROUP_PORT.
GROUP_INDEX_ENV = "LWS_WORKER_INDEX"
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
GROUP_PORT_NAME = "group"
GROUP_PORT = 29500


def group_ranks(ranks: list[int], pods: int, index: int) -> list[int]:
    """The ranks pod `index` of a `pods`-pod replica drives: its contiguous share of `ranks`
    (pod i of the source group and pod i of a target hold the same ranks: rank-matched P2P)."""
    if pods < 1 or len(ranks) % pods or not 0 <= index < pods:
        raise ValueError(f"pod {index} of {pods}: {len(ranks)} ranks do not split evenly")
    share = len(ranks) // pods
    return ranks[index * share : (index + 1) * share]


class PeerCandidate(ApiModel):
    pod: str = Field(description="Source pod name.")
    address: str = Field(description="host:port of the source worker's HTTP endpoint.")


class PeerHandoff(ApiModel):
    """What the operator hands a Target (the weightlift.dev/peers annotation): peers to pull
    from, or storage. Neither: keep waiting in Standby."""

    peers: list[PeerCandidate] = Field(default_factory=list)
    storage: bool = False
    # A pod of a multi-pod replica: host:port of its group's torch.distributed rendezvous (the
    # leader pod's IP and GROUP_PORT). Handed with the role, because one LWS template serves
    # every group: a group's pods all start waiting, and learn here what they are.
    leader: str | None = None

    @property
    def given(self) -> bool:
        return bool(self.peers) or self.storage

    def to_text(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_defaults=True)

    @classmethod
    def parse(cls, text: str | None) -> PeerHandoff | None:
        """The annotation's hand-off; None when it is empty or not one (nothing handed yet)."""
        if not text or not text.strip():
            return None
        try:
            return cls.model_validate_json(text)
        except ValueError:
            return None


def plan_digest(text: str) -> str:
    """sha256 (hex) of the shared plan exactly as the ConfigMap holds it."""
    return hashlib.sha256(text.encode()).hexdigest()


class SharedPlan(ApiModel):
    """What every replica of one ModelDeployment revision is told alike (spec-derived)."""

    namespace: str = "default"
    deployment: str
    model_identity: str
    model: ModelSource
    served_model_name: str
    tensor_parallel: int = 1
    # The replica's ranks; one process drives all of them, or (pods_per_replica > 1) its pod's
    # group_ranks share, by its GROUP_INDEX_ENV.
    ranks: list[int] = Field(default_factory=lambda: [0])
    # Pods one replica spans, when more than one (None: one pod): a LeaderWorkerSet group, whose
    # pods wait in Standby for a hand-off (role and the group's leader) and compute together
    # over torch.distributed.
    pods_per_replica: int | None = None
    # Pipeline stages, when more than one (None: 1). A multi-pod replica's worker refuses more
    # than one (it runs tensor-parallel blocks only), so it must know.
    pipeline_parallel: int | None = None
    # "cpu", or "cuda" (the pod's i-th rank drives pod-local device i, whatever its rank
    # number); the operator writes "auto" and the worker decides.
    device: str = "auto"
    loading: LoadingSpec = Field(default_factory=LoadingSpec)
    init_hooks: InitHooks | None = None
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    probe: InferenceProbe | None = None
    host: str = "0.0.0.0"

    def to_text(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


class Assignment(ApiModel):
    """One replica's part: small, so it stays in the pod's env. model_dir is here because it is
    a path in this pod's mounts (the local process node rewrites mount paths in env values)."""

    pod_name: str
    replica: int = 0
    role: Role = Role.SOURCE
    # Local directory holding model.pt2 and the safetensors files (the resolved uri mount).
    model_dir: str
    # Candidates to pull from when role is Target, best first.
    peers: list[PeerCandidate] = Field(default_factory=list)
    # A warm spare (spec.warmSpares): it waits in Standby until the operator hands it peers or
    # storage, however long that takes; it never loads on its own. None: not a spare.
    spare: bool | None = None

    def to_text(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


class WorkerPlan(SharedPlan, Assignment):
    """What one worker runs: its replica's shared plan and its own assignment, in one document
    (the pod's plan file; `compose` and `split` convert)."""

    @property
    def strategy(self) -> LoadStrategy:
        return LoadStrategy(self.loading.strategy)

    @classmethod
    def compose(cls, shared: SharedPlan, assignment: Assignment) -> WorkerPlan:
        return cls.model_validate({**shared.wire(), **assignment.wire()})

    def split(self) -> tuple[SharedPlan, Assignment]:
        doc = self.wire()
        shared = {k: v for k, v in doc.items() if k in _SHARED_KEYS}
        return SharedPlan.model_validate(shared), Assignment.model_validate(
            {k: v for k, v in doc.items() if k not in _SHARED_KEYS}
        )

    @classmethod
    def from_file(cls, path: Path) -> WorkerPlan:
        return cls.model_validate_json(path.read_text())


_SHARED_KEYS = {info.alias or name for name, info in SharedPlan.model_fields.items()}
_SHARED_KEYS |= set(SharedPlan.model_fields)


class WorkerPhase(StrEnum):
    """A worker's own lifecycle, reported at /weightlift/v1/status."""

    STARTING = "Starting"
    INIT_HOOKS = "InitHooks"
    # A Target that did everything that needs no weights (program opened, hooks run, memory
    # faulted) and waits for the operator to hand it peers (or storage).
    STANDBY = "Standby"
    LOADING = "Loading"
    SERVING = "Serving"
    FAILED = "Failed"
    STOPPING = "Stopping"


class HookReport(ApiModel):
    library: str
    device_index: int
    ok: bool
    message: str = ""


class WorkerReport(ApiModel):
    """What GET /weightlift/v1/status returns; the operator reads it into the replica status."""

    phase: WorkerPhase = WorkerPhase.STARTING
    message: str = ""
    # True when retrying cannot help (missing init symbol, corrupt file): the pod is not restarted.
    permanent_failure: bool = False
    model: str = ""
    model_identity: str = ""
    role: str = ""
    ranks: list[int] = Field(default_factory=list)
    strategy: str = ""  # the loader actually used: preload | direct | p2p
    loaded_from: str | None = None  # "storage:<scheme>" | "cache" | "peer:<pod>"
    bytes_loaded: int = 0
    bytes_total: int = 0
    gbps: float | None = None
    load_seconds: float | None = None
    # Per rank that pulled (or tried to) from a peer: the transport UCX named, and why it was
    # given up for storage (software emulation of GPU memory), if it was.
    transports: list[RankTransport] = Field(default_factory=list)
    # The engine's compiled program: hit (peer) | hit (store) | miss (<reason>) | none ("" before
    # the engine says).
    compile_cache: str = ""
    hooks_run: bool = False
    hooks: list[HookReport] = Field(default_factory=list)
    # Where the load's seconds went, per step of the loader (P2P: manifest, alloc, agent,
    # transfer, verify), the slowest rank's.
    load_phases: dict[str, float] = Field(default_factory=dict)
    # The engine's own ports by protocol (Triton: http, grpc, metrics); empty without one.
    engine_ports: dict[str, int] = Field(default_factory=dict)
    # Wall-clock (Unix seconds) at which each step of this worker ended: process (started),
    # server (HTTP up), hooks, load, bind, serving.
    timeline: dict[str, float] = Field(default_factory=dict)
