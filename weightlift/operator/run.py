"""`weightlift operator`: kopf with our settings, namespaces and a liveness endpoint."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import click

from weightlift.api.worker import (
    COMPILE_CACHE_MAX_BYTES_ENV,
    COMPILE_STORE_ENV,
    COMPILE_STORE_MAX_BYTES_ENV,
    COMPILE_STORE_S3_ENDPOINT_ENV,
    COMPILE_STORE_URI_ENV,
    DEFAULT_COMPILE_STORE,
    DEFAULT_COMPILE_STORE_MAX_BYTES,
)
from weightlift.operator.malloc import tune_malloc
from weightlift.operator.settings import (
    COMPILE_STORE_SECRET_ENV,
    DEFAULT_LEASE_NAME,
    MODEL_PATH_PREFIXES_ENV,
    PROBE_NETWORKS_ENV,
    WORKER_IMAGE_PULL_SECRETS_ENV,
    LeaderElection,
    default_identity,
    default_lease_namespace,
    parse_networks,
    parse_path_prefixes,
    parse_secret_names,
    parse_store_path,
    parse_store_uri,
)

if TYPE_CHECKING:
    from weightlift.operator.leader import Elector

LOG_LEVELS = ("debug", "info", "warning", "error")
# kopf namespace patterns: a name with one of these is a glob (or a negation), found by scanning.
GLOB_CHARS = set("*?[!")


@click.command("operator")
@click.option("--namespace", "-n", "namespaces", multiple=True, help="Namespace to watch (repeat).")
@click.option("--all-namespaces", "-A", is_flag=True, help="Watch the whole cluster.")
@click.option(
    "--liveness-port", type=int, default=None, help="Serve kopf's liveness probe on /healthz."
)
@click.option(
    "--liveness-host",
    default="0.0.0.0",
    show_default=True,
    help="Address the liveness endpoint binds (e.g. the pod IP).",
)
@click.option(
    "--probe-networks",
    default=None,
    help=f"Only contact pod IPs in these CIDRs (comma separated; env {PROBE_NETWORKS_ENV}).",
)
@click.option(
    "--model-path-prefix",
    "path_prefixes",
    multiple=True,
    help="A directory below which hostpath:// and file:// model URIs are allowed (repeat; env "
    f"{MODEL_PATH_PREFIXES_ENV}, comma separated). None given: such URIs are refused.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
    help="Log level (--verbose is debug).",
)
@click.option(
    "--compile-cache-max-bytes",
    type=click.IntRange(min=0),
    default=None,
    help="The most bytes of engine compile cache a target fetches from its source (passed to "
    f"worker pods as {COMPILE_CACHE_MAX_BYTES_ENV}); bigger caches are compiled instead.",
)
@click.option(
    "--compile-store",
    default=None,
    help="Node directory (a hostPath) where vLLM compile caches outlive replicas; '' for none "
    f"[${COMPILE_STORE_ENV}, default {DEFAULT_COMPILE_STORE}].",
)
@click.option(
    "--compile-store-max-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="The node store's bound; least recently used entries are evicted "
    f"[${COMPILE_STORE_MAX_BYTES_ENV}, default {DEFAULT_COMPILE_STORE_MAX_BYTES}].",
)
@click.option(
    "--compile-store-uri",
    default=None,
    help="The cluster's compile-cache store, s3://bucket/prefix, for replicas on every node "
    f"[${COMPILE_STORE_URI_ENV}].",
)
@click.option(
    "--compile-store-s3-endpoint",
    default=None,
    help=f"Its S3 endpoint (MinIO, ...; none: AWS) [${COMPILE_STORE_S3_ENDPOINT_ENV}].",
)
@click.option(
    "--compile-store-secret",
    default=None,
    help="The Secret, in each worker namespace, whose AWS_ACCESS_KEY_ID and "
    f"AWS_SECRET_ACCESS_KEY sign it [${COMPILE_STORE_SECRET_ENV}].",
)
@click.option(
    "--worker-image-pull-secret",
    "worker_pull_secrets",
    multiple=True,
    help="A Secret every worker pod pulls its images with (repeat) "
    f"[${WORKER_IMAGE_PULL_SECRETS_ENV}, comma separated].",
)
@click.option(
    "--leader-elect/--no-leader-elect",
    default=False,
    envvar="WEIGHTLIFT_LEADER_ELECT",
    show_default=True,
    help="Reconcile only while holding a coordination.k8s.io Lease (run several replicas: one "
    "acts, the others wait in standby).",
)
@click.option("--lease-name", default=DEFAULT_LEASE_NAME, show_default=True, help="The Lease.")
@click.option("--lease-namespace", default=None, help="The Lease's namespace [$POD_NAMESPACE].")
@click.option("--lease-identity", default=None, help="This candidate's holderIdentity [$POD_NAME].")
@click.option(
    "--lease-duration",
    type=click.FloatRange(min=1),
    default=LeaderElection.lease_duration,
    show_default=True,
    help="Seconds a standby waits after the last renewal it saw before it takes the Lease.",
)
@click.option(
    "--renew-deadline",
    type=click.FloatRange(min=0, min_open=True),
    default=LeaderElection.renew_deadline,
    show_default=True,
    help="Seconds the leader keeps trying to renew before it exits (< --lease-duration).",
)
@click.option(
    "--retry-period",
    type=click.FloatRange(min=0, min_open=True),
    default=LeaderElection.retry_period,
    show_default=True,
    help="Seconds between tries to take or renew the Lease.",
)
@click.option("--verbose", "-v", is_flag=True, help="Debug logging (--log-level debug).")
def operator_command(
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    liveness_port: int | None,
    liveness_host: str,
    probe_networks: str | None,
    path_prefixes: tuple[str, ...],
    log_level: str,
    compile_cache_max_bytes: int | None,
    compile_store: str | None,
    compile_store_max_bytes: int | None,
    compile_store_uri: str | None,
    compile_store_s3_endpoint: str | None,
    compile_store_secret: str | None,
    worker_pull_secrets: tuple[str, ...],
    leader_elect: bool,
    lease_name: str,
    lease_namespace: str | None,
    lease_identity: str | None,
    lease_duration: float,
    renew_deadline: float,
    retry_period: float,
    verbose: bool,
) -> None:
    """Run the weightlift operator against the current kubeconfig (or in-cluster config)."""
    import kopf

    if not namespaces and not all_namespaces:
        env_ns = os.environ.get("WATCH_NAMESPACES", "")
        namespaces = tuple(ns for ns in env_ns.split(",") if ns)
        if not namespaces:
            raise click.UsageError("give --namespace NS (repeatable) or --all-namespaces")
    # Flags win over the env; the handlers read both into one Settings at start-up.
    if probe_networks:
        os.environ[PROBE_NETWORKS_ENV] = probe_networks
    try:
        parse_networks(os.environ.get(PROBE_NETWORKS_ENV, ""))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--probe-networks") from exc
    if path_prefixes:
        os.environ[MODEL_PATH_PREFIXES_ENV] = ",".join(path_prefixes)
    try:
        parse_path_prefixes(os.environ.get(MODEL_PATH_PREFIXES_ENV, ""))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model-path-prefix") from exc
    _pull_secret_settings(worker_pull_secrets)
    if compile_cache_max_bytes is not None:
        os.environ[COMPILE_CACHE_MAX_BYTES_ENV] = str(compile_cache_max_bytes)
    _store_settings(
        compile_store,
        compile_store_max_bytes,
        compile_store_uri,
        compile_store_s3_endpoint,
        compile_store_secret,
    )
    election: LeaderElection | None = None
    if leader_elect:
        try:
            election = LeaderElection(
                lease_name=lease_name,
                namespace=lease_namespace or default_lease_namespace(),
                identity=lease_identity or default_identity(),
                lease_duration=lease_duration,
                renew_deadline=renew_deadline,
                retry_period=retry_period,
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--renew-deadline") from exc
    level = logging.DEBUG if verbose else getattr(logging, log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("kopf.objects").addFilter(_drop_handler_successes)
    # Before kopf starts its threads: the arena limit holds only for arenas not made yet.
    logging.getLogger(__name__).info("malloc settings: %s", tune_malloc() or "glibc's own")
    import weightlift.operator.handlers  # noqa: F401  (registers the handlers)

    settings = kopf.OperatorSettings()
    # Named namespaces only: nothing to discover, so no cluster-wide list/watch of namespaces
    # and CRDs (the chart grants those only in cluster-wide mode). Scanning on, kopf retried a
    # forbidden namespace LIST for a minute before it served the named ones.
    settings.scanning.disabled = not all_namespaces and not any(
        set(ns) & GLOB_CHARS for ns in namespaces
    )
    elector = _lead(election, liveness_host, liveness_port) if election else None
    try:
        kopf.run(
            settings=settings,
            standalone=True,
            clusterwide=all_namespaces,
            namespaces=() if all_namespaces else namespaces,
            liveness_endpoint=f"http://{liveness_host}:{liveness_port}/healthz"
            if liveness_port
            else None,
        )
    finally:
        # kopf has stopped (asyncio.run waited for its API threads): hand the Lease on.
        if elector is not None:
            elector.release()


def _pull_secret_settings(names: tuple[str, ...]) -> None:
    """The workers' pull secrets into the env the handlers' Settings read (flags win)."""
    if names:
        os.environ[WORKER_IMAGE_PULL_SECRETS_ENV] = ",".join(names)
    try:
        parse_secret_names(os.environ.get(WORKER_IMAGE_PULL_SECRETS_ENV, ""))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-image-pull-secret") from exc


def _store_settings(
    compile_store: str | None,
    compile_store_max_bytes: int | None,
    compile_store_uri: str | None,
    compile_store_s3_endpoint: str | None,
    compile_store_secret: str | None,
) -> None:
    """The compile-store flags into the env the handlers' Settings read (flags win)."""
    if compile_store is not None:
        os.environ[COMPILE_STORE_ENV] = compile_store
    if compile_store_max_bytes is not None:
        os.environ[COMPILE_STORE_MAX_BYTES_ENV] = str(compile_store_max_bytes)
    for name, value in (
        (COMPILE_STORE_URI_ENV, compile_store_uri),
        (COMPILE_STORE_S3_ENDPOINT_ENV, compile_store_s3_endpoint),
        (COMPILE_STORE_SECRET_ENV, compile_store_secret),
    ):
        if value is not None:
            os.environ[name] = value
    try:
        parse_store_path(os.environ.get(COMPILE_STORE_ENV, DEFAULT_COMPILE_STORE))
        parse_store_uri(os.environ.get(COMPILE_STORE_URI_ENV, ""))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--compile-store[-uri]") from exc


def _lead(election: LeaderElection, host: str, port: int | None) -> Elector:
    """Wait in standby (answering liveness probes) until this replica holds the Lease, then keep
    renewing it in a thread: kopf starts only after this returns."""
    from kubernetes import client

    from weightlift.operator import metrics
    from weightlift.operator.kube import load_config
    from weightlift.operator.leader import Elector
    from weightlift.operator.lease_health import serve_standby_health
    from weightlift.operator.settings import Settings

    elector = Elector(election, client.CoordinationV1Api(load_config()))
    # What the leader's first steps import (the client's API classes build hundreds of pydantic
    # models: 4 s of a takeover on a busy 2-core machine, 20 s when worker processes started
    # beside it), imported while waiting instead.
    _ = (client.CoreV1Api, client.CustomObjectsApi)
    health = serve_standby_health(host, port, elector.alive) if port else contextlib.nullcontext()
    # The standby is scraped too (the metrics Service selects every replica): it serves the
    # process's registry while it waits, and frees the port for the leader's own server.
    wanted = Settings.from_environment()
    scraped = None
    if wanted.metrics_port is not None:
        scraped = metrics.serve(wanted.metrics_host, wanted.metrics_port)
    with health:
        elector.acquire()
    if scraped is not None:
        scraped.shutdown()
        scraped.server_close()
    elector.start_renewing()
    return elector


def _drop_handler_successes(record: logging.LogRecord) -> bool:
    """kopf logs "Handler 'x' succeeded." at INFO for every watch event a handler sees (20 lines
    per deployment in a rollout, the pods' status changes mostly), and has no setting for it;
    our handlers log what they did themselves. Failures and retries still pass."""
    return not (record.levelno == logging.INFO and str(record.msg).endswith(" succeeded."))
