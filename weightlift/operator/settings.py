"""The operator's settings: read and checked once when it starts, one frozen object after.

`weightlift operator` takes them as flags (or the env variables below, which the chart sets);
every pass and probe reads the object, never the environment.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from weightlift.api.limits import DNS_SUBDOMAIN, DNS_SUBDOMAIN_MAX
from weightlift.api.worker import (
    COMPILE_CACHE_MAX_BYTES_ENV,
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    COMPILE_STORE_S3_ENDPOINT_ENV,
    COMPILE_STORE_URI_ENV,
    DEFAULT_COMPILE_STORE,
    DEFAULT_COMPILE_STORE_MAX_BYTES,
)

MODEL_PATH_PREFIXES_ENV = "WEIGHTLIFT_MODEL_PATH_PREFIXES"
PROBE_NETWORKS_ENV = "WEIGHTLIFT_PROBE_NETWORKS"
# /metrics (Prometheus) on this port and address; no port: not served.
METRICS_PORT_ENV = "WEIGHTLIFT_METRICS_PORT"
# The Secret with the cluster compile store's S3 credentials (the operator names it to pods).
COMPILE_STORE_SECRET_ENV = "WEIGHTLIFT_COMPILE_STORE_SECRET"
METRICS_HOST_ENV = "WEIGHTLIFT_METRICS_HOST"
# Pull secrets (names, comma separated) every worker pod gets: the chart's workerImagePullSecrets.
WORKER_IMAGE_PULL_SECRETS_ENV = "WEIGHTLIFT_WORKER_IMAGE_PULL_SECRETS"
# Leader election (the chart sets the pod's name and namespace from the downward API).
POD_NAME_ENV = "POD_NAME"
POD_NAMESPACE_ENV = "POD_NAMESPACE"
DEFAULT_LEASE_NAME = "weightlift-operator"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _split(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def parse_path_prefixes(raw: str) -> tuple[str, ...]:
    """Directories hostpath:// and file:// URIs may name: comma separated, each absolute and
    normalised and not / (ValueError naming the variable otherwise)."""
    prefixes = tuple(_split(raw))
    for prefix in prefixes:
        if not prefix.startswith("/") or prefix == "/" or posixpath.normpath(prefix) != prefix:
            raise ValueError(
                f"{MODEL_PATH_PREFIXES_ENV}: {prefix!r} is not an absolute, normalised directory "
                "other than /"
            )
    return prefixes


def parse_secret_names(raw: str) -> tuple[str, ...]:
    """Secret names, comma separated, each a DNS subdomain (ValueError naming the variable)."""
    names = tuple(dict.fromkeys(_split(raw)))  # in order, once each
    for name in names:
        if len(name) > DNS_SUBDOMAIN_MAX or not re.match(DNS_SUBDOMAIN, name):
            raise ValueError(
                f"{WORKER_IMAGE_PULL_SECRETS_ENV}: {name!r} is not a Secret name (a DNS subdomain)"
            )
    return names


def parse_networks(raw: str) -> tuple[Network, ...] | None:
    """CIDRs the operator may contact (None: anywhere); ValueError naming the variable."""
    parts = _split(raw)
    if not parts:
        return None
    try:
        return tuple(ipaddress.ip_network(part, strict=False) for part in parts)
    except ValueError as exc:
        raise ValueError(f"{PROBE_NETWORKS_ENV}: {exc}") from None


def parse_max_bytes(raw: str, variable: str = COMPILE_CACHE_MAX_BYTES_ENV) -> int | None:
    """A byte bound (None when unset); ValueError naming the variable."""
    if not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{variable}: {raw!r} is not a byte count >= 0")
    return value


def parse_store_path(raw: str) -> str:
    """An absolute node path, or "" (no store); ValueError naming the variable."""
    path = raw.strip()
    if path and (not path.startswith("/") or any(c.isspace() for c in path)):
        raise ValueError(f"{COMPILE_STORE_ENV}: {raw!r} is not an absolute path")
    return posixpath.normpath(path) if path else ""


def parse_store_uri(raw: str) -> str:
    """s3://bucket[/prefix] or pvc://claim[/path] (ReadWriteMany), or "" (no cluster store);
    ValueError naming the variable."""
    uri = raw.strip()
    scheme, _, rest = uri.partition("://")
    parts = rest.split("/")
    if uri and (scheme not in ("s3", "pvc") or not parts[0] or ".." in parts):
        raise ValueError(
            f"{COMPILE_STORE_URI_ENV}: {raw!r} is not s3://bucket[/prefix] or pvc://claim[/path]"
        )
    return uri


def parse_port(raw: str) -> int | None:
    """A TCP port (None when unset); ValueError naming the variable."""
    if not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV}: {raw!r} is not a TCP port (1-65535)")
    return value


@dataclass(frozen=True)
class Settings:
    """What the operator was started with."""

    # hostpath:// and file:// URIs must lie below one of these (none: such URIs are refused).
    model_path_prefixes: tuple[str, ...] = ()
    # Pod IPs the operator may send status reads and probes to; None: any. Simulated pods
    # (kwok) have made-up addresses that must not receive traffic.
    probe_networks: tuple[Network, ...] | None = None
    # The most compile-cache bytes a worker fetches from its source (None: the worker's default).
    compile_cache_max_bytes: int | None = None
    # The node directory of vLLM compile caches that outlive replicas ("": none) and its bound.
    compile_store: str = DEFAULT_COMPILE_STORE
    compile_store_max_bytes: int = DEFAULT_COMPILE_STORE_MAX_BYTES
    # The cluster's store (s3://bucket/prefix, "": none), its S3 endpoint ("": AWS) and the
    # Secret (in the worker's namespace) whose AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY sign it.
    compile_store_uri: str = ""
    compile_store_s3_endpoint: str = ""
    compile_store_secret: str = ""
    # Where /metrics is served (metrics.serve); None: nowhere.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    # imagePullSecrets of every worker pod (Secrets in its namespace), before the template's own.
    worker_image_pull_secrets: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(
            model_path_prefixes=parse_path_prefixes(env.get(MODEL_PATH_PREFIXES_ENV, "")),
            probe_networks=parse_networks(env.get(PROBE_NETWORKS_ENV, "")),
            compile_cache_max_bytes=parse_max_bytes(env.get(COMPILE_CACHE_MAX_BYTES_ENV, "")),
            compile_store=parse_store_path(env.get(COMPILE_STORE_ENV, DEFAULT_COMPILE_STORE)),
            compile_store_max_bytes=parse_max_bytes(
                env.get(COMPILE_STORE_MAX_BYTES_ENV, ""), COMPILE_STORE_MAX_BYTES_ENV
            )
            or DEFAULT_COMPILE_STORE_MAX_BYTES,
            compile_store_uri=parse_store_uri(env.get(COMPILE_STORE_URI_ENV, "")),
            compile_store_s3_endpoint=env.get(COMPILE_STORE_S3_ENDPOINT_ENV, "").strip(),
            compile_store_secret=env.get(COMPILE_STORE_SECRET_ENV, "").strip(),
            metrics_port=parse_port(env.get(METRICS_PORT_ENV, "")),
            metrics_host=env.get(METRICS_HOST_ENV, "").strip() or "0.0.0.0",
            worker_image_pull_secrets=parse_secret_names(
                env.get(WORKER_IMAGE_PULL_SECRETS_ENV, "")
            ),
        )

    def may_contact(self, pod_ip: str) -> bool:
        """False for pod IPs outside `probe_networks` (when set) and for non-addresses."""
        if self.probe_networks is None:
            return True
        try:
            address = ipaddress.ip_address(pod_ip)
        except ValueError:
            return False
        return any(address in net for net in self.probe_networks)


@dataclass(frozen=True)
class LeaderElection:
    """One active operator among replicas, through a coordination.k8s.io Lease (leader.py).

    client-go's semantics and controller-runtime's defaults: a standby takes the Lease once its
    holder has not renewed it for `lease_duration` seconds (by the standby's own clock, from
    when it first saw the record unchanged); the holder gives up (the process exits) when it
    could not renew for `renew_deadline`; everyone retries every `retry_period`. A holder that
    dies is replaced after at most lease_duration + retry_period (17 s with these defaults).
    """

    lease_name: str = DEFAULT_LEASE_NAME
    namespace: str = "default"
    # Unique among candidates: the pod's name in a cluster; host and pid for local processes.
    identity: str = ""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            object.__setattr__(self, "identity", default_identity())
        # client-go's checks: the holder must give up before anyone may take over, and try
        # more than once before it does.
        if not 0 < self.retry_period * 1.2 < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election: need 0 < 1.2 x retry period < renew deadline < lease "
                f"duration, got {self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


def default_identity(environ: Mapping[str, str] | None = None) -> str:
    """$POD_NAME (the chart's downward API), else host_pid: two local operators differ."""
    env = os.environ if environ is None else environ
    return env.get(POD_NAME_ENV) or f"{socket.gethostname()}_{os.getpid()}"


def default_lease_namespace(environ: Mapping[str, str] | None = None) -> str:
    """$POD_NAMESPACE (the operator's own namespace in a cluster), else default."""
    env = os.environ if environ is None else environ
    return env.get(POD_NAMESPACE_ENV) or "default"
