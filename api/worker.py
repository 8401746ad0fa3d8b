"""The worker's plan: everything the operator tells one worker process (JSON in WEIGHTLIFT_PLAN).

The contract between operator and worker: the operator builds the plan, the worker reports back.
"""

from __future__ import annotations

import json
import os
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
    Role,
    RuntimeSpec,
)

PLAN_ENV = "WEIGHTLIFT_PLAN"


class PeerCandidate(ApiModel):
    pod: str = Field(description="Source pod name.")
    address: str = Field(description="host:port of the source worker's HTTP endpoint.")


class WorkerPlan(ApiModel):
    namespace: str = "default"
    deployment: str
    pod_name: str
    replica: int = 0
    role: Role = Role.SOURCE
    model_identity: str
    model: ModelSource
    # Local directory holding model.pt2 and the safetensors files (the resolved uri mount).
    model_dir: str
    served_model_name: str
    tensor_parallel: int = 1
    # Ranks this process drives; one process may drive all local ranks of a replica.
    ranks: list[int] = Field(default_factory=lambda: [0])
    # "cpu", or "cuda" (rank r uses cuda:r) ; the operator writes "auto" and the worker decides.
    device: str = "auto"
    loading: LoadingSpec = Field(default_factory=LoadingSpec)
    # Candidates to pull from when role is Target, best first.
    peers: list[PeerCandidate] = Field(default_factory=list)
    init_hooks: InitHooks | None = None
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    probe: InferenceProbe | None = None
    host: str = "0.0.0.0"

    @property
    def strategy(self) -> LoadStrategy:
        return LoadStrategy(self.loading.strategy)

    def to_env(self) -> str:
        return json.dumps(self.wire(), separators=(",", ":"))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WorkerPlan:
        env = os.environ if environ is None else environ
        if PLAN_ENV not in env:
            raise ValueError(f"{PLAN_ENV} is not set and no --plan file was given")
        return cls.model_validate_json(env[PLAN_ENV])

    @classmethod
    def from_file(cls, path: Path) -> WorkerPlan:
        return cls.model_validate_json(path.read_text())


class WorkerPhase(StrEnum):
    """A worker's own lifecycle, reported at /weightlift/v1/status."""

    STARTING = "Starting"
    INIT_HOOKS = "InitHooks"
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
    hooks_run: bool = False
    hooks: list[HookReport] = Field(default_factory=list)
    # Where the load's seconds went, per step of the loader (P2P: manifest, alloc, agent,
    # transfer, verify), the slowest rank's.
    load_phases: dict[str, float] = Field(default_factory=dict)
    # Wall-clock (Unix seconds) at which each step of this worker ended: process (started),
    # server (HTTP up), hooks, load, bind, serving.
    timeline: dict[str, float] = Field(default_factory=dict)
