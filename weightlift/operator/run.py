"""`weightlift operator`: kopf with our settings, namespaces and a liveness endpoint."""

from __future__ import annotations

import logging
import os

import click

from weightlift.api.worker import COMPILE_CACHE_MAX_BYTES_ENV
from weightlift.operator.malloc import tune_malloc
from weightlift.operator.settings import (
    MODEL_PATH_PREFIXES_ENV,
    PROBE_NETWORKS_ENV,
    parse_networks,
    parse_path_prefixes,
)

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
    if compile_cache_max_bytes is not None:
        os.environ[COMPILE_CACHE_MAX_BYTES_ENV] = str(compile_cache_max_bytes)
    level = logging.DEBUG if verbose else getattr(logging, log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    kopf.run(
        settings=settings,
        standalone=True,
        clusterwide=all_namespaces,
        namespaces=() if all_namespaces else namespaces,
        liveness_endpoint=f"http://{liveness_host}:{liveness_port}/healthz"
        if liveness_port
        else None,
    )
