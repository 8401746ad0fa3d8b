"""What every part of the process node shares: its settings, the record of a container run,
and the small helpers that write files and expand values the way a kubelet does."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from weightlift.local.kube import JSON, Kube
from weightlift.local.procs import child_options

log = logging.getLogger("weightlift.processnode")


LOCAL_NODE_LABEL = "weightlift.dev/local-node"
PROCESS_NODE_ANNOTATION = "weightlift.dev/process-node"
RUNTIME_VERSION = "weightlift-process://0.1.0"
LEASE_SECONDS = 40
MAX_BACKOFF_SECONDS = 20.0
LOG_TAIL_BYTES = 2048


def pod_process(log: IO[bytes], cwd: str, env: dict[str, str]) -> dict[str, Any]:
    """How a pod's process starts. It dies with the node: SIGKILL, as when a machine loses
    power (no grace period)."""
    return child_options(log, cwd=cwd, env=env, die_with=signal.SIGKILL)


def key(pod: JSON) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


# ----------------------------------------------------------------------------------- config


@dataclass
class NodeConfig:
    name: str
    state_dir: Path
    gpus: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    # Generous on purpose: the node runs processes, it does not enforce requests.
    cpu: str = "64"
    memory: str = "512Gi"
    max_pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_seconds: float = 10.0
    # Where `weightlift` and `python` of this installation live; bare commands resolve here first.
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    # Extra environment for every process (e.g. CUDA_VISIBLE_DEVICES="").
    extra_env: dict[str, str] = field(default_factory=dict)
    # Host environment variables passed through (a container would not see the host env).
    # PYTHONPATH: a checkout run without installing (a git worktree) reaches its worker pods.
    passthrough_env: tuple[str, ...] = ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "PYTHONPATH")
    # Container image -> a root filesystem of it (weightlift/local/images.py): containers of
    # these images run chrooted there, from the image's files instead of this installation.
    image_roots: dict[str, Path] = field(default_factory=dict)
    delete_node_on_stop: bool = True
    # Third octet range for pod IPs 127.0.x.y; the start is derived from the node name and this
    # process, so two stacks on one machine (parallel test runs) rarely hand out the same IP: the
    # free-address check at allocation cannot see a pod the other stack is about to start.
    ip_octets: tuple[int, int] = (16, 250)


# ------------------------------------------------------------------------------ pod runner


@dataclass
class ProbeState:
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    ok: bool = False


@dataclass
class ContainerRun:
    spec: JSON
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    restart_count: int = 0
    last_terminated: JSON | None = None
    terminated: JSON | None = None  # current state when not running
    waiting: JSON | None = None
    restart_at: float = 0.0
    backoff: float = 1.0
    started_mono: float = 0.0
    readiness: ProbeState = field(default_factory=ProbeState)
    liveness: ProbeState = field(default_factory=ProbeState)

    @property
    def name(self) -> str:
        name: str = self.spec["name"]
        return name

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PodHost(Protocol):
    """What a pod's runner needs of its node (node.py's ProcessNode): the node owns its
    runners, so the runner sees it only through this, and neither module imports the other."""

    config: NodeConfig
    kube: Kube
    host_ip: str
    stopping: threading.Event

    @property
    def fault_gate_dir(self) -> Path: ...

    def event(self, pod: JSON, kind: str, reason: str, message: str) -> None: ...

    def runner_done(self, uid: str, runner: object, finished: bool) -> None:
        """The runner's thread ended; `finished`: its pod is gone or was deleted by it."""


class ConfigError(Exception):
    """The pod asks for something the process node cannot provide (CreateContainerConfigError)."""


def refuse_nul(container: str, argv: list[str], env: dict[str, str]) -> None:
    """execve cannot pass a NUL byte (Popen raises ValueError): say which value has one, as a
    container config error, instead of crashing the pod's runner."""
    for name, value in env.items():
        if "\0" in name or "\0" in value:
            raise ConfigError(f"container {container}: env {name!r} contains a NUL byte")
    for i, arg in enumerate(argv):
        if "\0" in arg:
            raise ConfigError(f"container {container}: argument {i} contains a NUL byte")


DATA_LINK = "..data"


def write_atomic(root: Path, data: dict[str, str]) -> Path:
    """Write `data` (relative path -> text) into `root` the way the kubelet's AtomicWriter does:
    the files go into a new timestamped dir, `..data` is switched to it by renaming a symlink
    over it (atomic), each top-level name is a symlink through `..data`, the old dir goes."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
    fresh = Path(tempfile.mkdtemp(prefix=stamp, dir=root))
    fresh.chmod(0o755)
    for rel, text in data.items():
        out = fresh / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.chmod(0o644)
    link = root / DATA_LINK
    old = os.readlink(link) if link.is_symlink() else None
    tmp = root / f"{DATA_LINK}_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(fresh.name)
    os.replace(tmp, link)
    for top in {Path(rel).parts[0] for rel in data}:
        visible = root / top
        if not visible.is_symlink():
            visible.symlink_to(f"{DATA_LINK}/{top}")
    if old is not None and old != fresh.name:
        shutil.rmtree(root / old, ignore_errors=True)
    return root


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion; $$(VAR) escapes; unknown references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def map_strings(doc: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(doc, str):
        return fn(doc)
    if isinstance(doc, list):
        return [map_strings(x, fn) for x in doc]
    if isinstance(doc, dict):
        return {k: map_strings(v, fn) for k, v in doc.items()}
    return doc
