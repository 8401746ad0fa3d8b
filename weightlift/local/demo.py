"""`weightlift demo`: the whole lifecycle on one machine, for real.

The stack (stack.py: control plane, process node, operator), a demo model with an init hook
(`weightlift model make-demo`) and one ModelDeployment. The view follows each replica from
Pending to Ready (observe.py); the summary (and `--json`) says where each replica's weights came
from and how long it took.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import click
import httpx

from weightlift.local.demo_stores import STORAGE_KINDS, DemoStorage, prepare_storage
from weightlift.local.kube import JSON, KUBE_ERRORS, describe
from weightlift.local.nodekind import NODE_KINDS, NodeKindName
from weightlift.local.observe import TIMELINE_STEPS, Observer, complete, generate, infer
from weightlift.local.prometheus import LocalPrometheus
from weightlift.local.scaleup import ScaleUp, spare_then_cold
from weightlift.local.stack import (
    VLLM_ENV,
    LocalStack,
    add_hook_library,
    engine_image,
    make_demo_model,
    model_deployment,
    vllm_engine_args,
)

log = logging.getLogger("weightlift.demo")

INSTALL_KINDS = ("process", "helm")
# waitForSourceSeconds counts from when the targets start waiting, that is from their pods'
# creation: on a real node a cold pull of the engine image (3 GB compressed for worker-vllm, 1.5-3
# min here) comes before the source's start, and 300 s sent the waiting vLLM target to storage.
REAL_NODE_WAIT_FOR_SOURCE = 900
# What fails the demo with a message (not a traceback).
DEMO_ERRORS: tuple[type[Exception], ...] = (TimeoutError, RuntimeError, *KUBE_ERRORS)

# ---------------------------------------------------------------------------------- view


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e6:.1f} MB"


def render(obs: Observer) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    st = obs.status()
    elapsed = time.monotonic() - obs.started
    head = Text.assemble(
        ("weightlift demo ", "bold"),
        (f"{obs.name}  ", "cyan"),
        (f"phase {obs.phase()}  ", "bold green" if obs.phase() == "Ready" else "bold yellow"),
        f"ready {st.get('ready', '0/0')}  sources {st.get('readySources', 0)}  "
        f"loaded {st.get('loaded', '0%')}  {elapsed:5.1f}s",
    )
    table = Table(expand=False)
    cols = ("replica", "role", "source", "phase", "loaded", "GB/s", "hooks", "compile", "probe")
    for col in cols:
        table.add_column(col)
    pod_phase = {p["metadata"]["name"]: (p.get("status") or {}).get("phase", "") for p in obs.pods}
    rows = obs.replica_statuses()
    seen = {r["name"] for r in rows}
    for rs in rows:
        total, loaded = int(rs.get("bytesTotal") or 0), int(rs.get("bytesLoaded") or 0)
        pct = f" {100 * loaded / total:3.0f}%" if total else ""
        gbps = rs.get("gbps")
        probe = rs.get("probe") or {}
        table.add_row(
            rs["name"],
            str(rs.get("role", "")),
            str(rs.get("loadedFrom") or "-"),
            "Ready" if rs.get("ready") else str(rs.get("phase", "")),
            f"{_fmt_bytes(loaded)}/{_fmt_bytes(total)}{pct}",
            f"{gbps:.2f}" if isinstance(gbps, int | float) else "-",
            {True: "ran", False: "no", None: "-"}[rs.get("hooksRun")],
            str(rs.get("compileCache") or "-")[:40],
            ("pass" if probe.get("passed") else str(probe.get("message", ""))[:40])
            if probe
            else "-",
        )
    for name, phase in sorted(pod_phase.items()):
        if name not in seen:
            table.add_row(name, "", "", f"pod {phase}", "", "", "", "", "")
    return Group(head, table, Text(str(st.get("message", "")), style="dim"))


# ----------------------------------------------------------------------------------- CLI


class _Terminated(Exception):
    pass


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.command("demo")
@click.option("--replicas", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option("--model-size-mb", type=float, default=64.0, show_default=True)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the summary as JSON here.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw where each replica's seconds went as a Gantt chart (PNG) here.",
)
@click.option(
    "--from-json",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Run nothing: print the tables of a summary an earlier --json wrote (and --plot it).",
)
@click.option(
    "--linger",
    type=float,
    default=0.0,
    show_default=True,
    help="Keep everything running this many seconds after Ready.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/demo"),
    show_default=True,
)
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Give up when not Ready after this many seconds.",
)
@click.option("--name", default="demo", show_default=True, help="ModelDeployment name.")
@click.option(
    "--storage",
    type=click.Choice(STORAGE_KINDS),
    default="hostpath",
    show_default=True,
    help="Where the model lives: a node directory, a PVC bound to one, or MinIO on loopback.",
)
@click.option(
    "--runtime",
    type=click.Choice(["builtin", "vllm", "triton"]),
    default="builtin",
    show_default=True,
    help="builtin: a PT2 demo model on weightlift's server. vllm: a tiny Llama on vLLM's CPU "
    "build with weightlift loading (its environment is built once under $WL_CACHE). triton: "
    "that Llama on a real tritonserver (nvidia-pytriton's), vLLM in its Python backend, "
    "probed through Triton's generate.",
)
@click.option(
    "--install",
    type=click.Choice(INSTALL_KINDS),
    default="process",
    show_default=True,
    help="process: the operator as a local process (admin kubeconfig). helm: `helm install` "
    "the chart; the operator runs as its pod under the chart's ServiceAccount.",
)
@click.option(
    "--node",
    "node_kind",
    type=click.Choice(NODE_KINDS),
    default="process",
    show_default=True,
    help="process: pods run as host processes (fast). kubelet: a real node, the pinned "
    "kubelet with containerd and runc; pods run as containers of the images `make images` "
    "built, pulled from a local registry (`make node`; needs root).",
)
@click.option(
    "--enforce-eager",
    is_flag=True,
    help="--runtime vllm without torch.compile (vLLM's --enforce-eager); default: compiled, and "
    "targets load the compiled program their source ships (the compile column).",
)
@click.option(
    "--scale-up",
    is_flag=True,
    help="After Ready: a scale-up (replicas+1, through the scale subresource) served by a warm "
    "spare (spec.warmSpares 1), then, spares set to 0, a cold one (replicas+2); each timed "
    "from the scale patch to Ready, also in --json (scaleUps).",
)
@click.option(
    "--pods-per-replica",
    type=click.IntRange(1, 8),
    default=1,
    show_default=True,
    help="Pods one replica spans (builtin runtime): a tensor-parallel model of that many ranks, "
    "one per pod, each replica a LeaderWorkerSet group (the real LWS controller, `make lws`); "
    "prints each group's per-rank table.",
)
@click.option(
    "--prometheus",
    "with_prometheus",
    is_flag=True,
    help="Run a real Prometheus (`make prometheus`) that scrapes the operator and the workers "
    "through Kubernetes service discovery; after Ready it stays up (with the stack) until "
    "Ctrl-C, or --linger seconds, and its URL is printed.",
)
def demo_command(
    replicas: int,
    model_size_mb: float,
    json_out: Path | None,
    plot: Path | None,
    from_json: Path | None,
    linger: float,
    state_dir: Path,
    timeout: float,
    name: str,
    storage: str,
    runtime: str,
    install: str,
    node_kind: NodeKindName,
    enforce_eager: bool,
    scale_up: bool,
    pods_per_replica: int,
    with_prometheus: bool,
) -> None:
    """Control plane, process node, operator, demo model, ModelDeployment: watch it get Ready."""
    from rich.console import Console
    from rich.live import Live

    # Not a terminal (CI, a pipe): rich would wrap at 80 columns; the tables need more.
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
    if from_json is not None:
        _print_tables(console, summary := json.loads(from_json.read_text()), name)
        return _draw(console, summary, plot, name)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    state_dir = state_dir.resolve()
    llm = runtime in ("vllm", "triton")
    engine = {"vllm": "vLLM", "triton": "Triton"}.get(runtime, "Builtin")
    model_dir = state_dir / ("llm" if llm else "model")
    groups = _parallelism(pods_per_replica, llm) is not None
    stack = LocalStack(
        state_dir,
        model_path_prefixes=(str(model_dir),),
        install=install,
        node_kind=node_kind,
        with_lws=groups,
        # A real node runs the engine's own image (`make images`); the process node, this venv.
        worker_image=engine_image(engine) if node_kind == "kubelet" else "",
    )
    where: DemoStorage | None = None
    prom: LocalPrometheus | None = None
    obs: Observer | None = None
    with _sigterm_raises():
        try:
            probe = _prepare_model(
                console, stack, runtime, model_dir, model_size_mb, pods_per_replica
            )
            operator = _bring_up(console, stack)
            prom = _start_prometheus(console, stack, state_dir) if with_prometheus else None
            with console.status(f"putting the model in {storage} storage"):
                where = prepare_storage(
                    storage, stack.kube, stack.namespace, name, model_dir, state_dir
                )
            console.print(f"[green]✓[/] model at {where.model['uri']}")
            manifest = _manifest(
                stack,
                name,
                model_dir,
                replicas,
                probe,
                where.model,
                engine,
                enforce_eager,
                warm_spares=1 if scale_up else 0,
                parallelism=_parallelism(pods_per_replica),
            )
            obs = Observer(stack, name)
            obs.watch_handoffs()
            stack.apply(manifest)
            with Live(render(obs), console=console, refresh_per_second=8) as live:
                obs.wait_ready(timeout, tick=lambda o: live.update(render(o)))
                live.update(render(obs))
            summary = {
                **obs.summary(),
                "storage": storage,
                "uri": where.model["uri"],
                "operator": operator,
            }
            ups = (lambda: _scale_ups(console, obs, replicas, timeout)) if scale_up else None
            if groups:
                _print_groups(console, summary, obs.replica_statuses())
            _report(console, summary, probe, name, json_out, plot, ups)
            _linger(console, stack, summary, name, linger, prom)
        except (KeyboardInterrupt, _Terminated):
            console.print("[yellow]interrupted; tearing down[/]")
            raise SystemExit(130) from None
        except DEMO_ERRORS as exc:
            console.print(f"[red]demo failed:[/] {describe(exc)}")
            console.print(f"[dim]operator log tail:\n{stack.operator_log_tail(20)}[/]")
            raise SystemExit(1) from None
        finally:
            _tear_down(console, stack, obs, prom, where)


def _tear_down(
    console: Any,
    stack: LocalStack,
    obs: Observer | None,
    prom: LocalPrometheus | None,
    where: DemoStorage | None,
) -> None:
    with console.status("tearing down (operator, worker processes, control plane)"):
        if obs is not None:
            obs.close()
        if prom is not None:
            prom.down()
        if where is not None:
            where.close()
        stack.down()
    console.print("[green]✓[/] everything stopped")


def _manifest(
    stack: LocalStack,
    name: str,
    model_dir: Path,
    replicas: int,
    probe: JSON,
    model: JSON,
    engine: str,
    enforce_eager: bool,
    **extra: Any,
) -> JSON:
    """The demo's ModelDeployment (on a real node, from the engine's image)."""
    real_node = stack.node_kind == "kubelet"
    llm = engine != "Builtin"
    return model_deployment(
        name,
        model_dir,
        replicas=replicas,
        probe=probe,
        model=model,
        engine=engine,
        engine_args=vllm_engine_args(enforce_eager) if llm else None,
        env=VLLM_ENV if llm else None,
        image=stack.worker_image or None,
        wait_for_source_seconds=REAL_NODE_WAIT_FOR_SOURCE if real_node else 300,
        **extra,
    )


def _bring_up(console: Any, stack: LocalStack) -> JSON:
    """The local cluster up; returns who runs the operator."""
    with console.status("bringing up the local cluster") as status:
        stack.up(progress=lambda msg: status.update(msg))
    operator = stack.operator_info()
    console.print(
        f"[green]✓[/] control plane, {stack.node_kind} node [bold]{stack.node_name}[/], "
        f"operator up ({_who(operator)})  (KUBECONFIG={stack.kubeconfig})"
    )
    return operator


def _prepare_model(
    console: Any, stack: LocalStack, runtime: str, model_dir: Path, size_mb: float, tp: int
) -> JSON:
    """The demo's model (a PT2 one of `tp` ranks, or the tiny Llama); returns its probe."""
    if runtime in ("vllm", "triton"):
        probe = _prepare_vllm(console, stack, model_dir)
        if runtime == "triton":
            _prepare_triton(console, stack)
    else:
        with console.status("making the demo model (PT2 + safetensors + init hook)"):
            probe = make_demo_model(model_dir, size_mb, tp=tp)
    console.print(f"[green]✓[/] demo model in {model_dir}")
    return probe


def _parallelism(pods_per_replica: int, llm: bool = False) -> JSON | None:
    """--pods-per-replica N: N tensor ranks, one per pod; None for one-pod replicas."""
    if pods_per_replica == 1:
        return None
    if llm:
        raise click.BadParameter(
            "multi-pod replicas run the builtin runtime", param_hint="--runtime"
        )
    return {"tensor": pods_per_replica, "podsPerReplica": pods_per_replica}


def _group_rows(replicas: list[JSON]) -> list[JSON]:
    """Each group's pods, as the status tells them (--json "groups")."""
    return [
        {"replica": r["name"], "role": r.get("role"), **pod}
        for r in replicas
        for pod in r.get("pods") or []
    ]


def _print_groups(console: Any, summary: JSON, replicas: list[JSON]) -> None:
    """The per-rank table of multi-pod replicas, also in --json ("groups")."""
    from rich.table import Table

    rows = summary["groups"] = _group_rows(replicas)
    table = Table(title="multi-pod replicas: each rank's pod, its shard and where it came from")
    for col in ("replica", "role", "pod", "ranks", "loaded from", "MB", "phase"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["replica"],
            str(row.get("role")),
            row["name"],
            ",".join(str(r) for r in row.get("ranks") or []),
            str(row.get("loadedFrom") or "-"),
            f"{row.get('bytesLoaded', 0) / 1e6:.1f}",
            str(row.get("phase")),
        )
    console.print(table)


def _linger(
    console: Any,
    stack: LocalStack,
    summary: JSON,
    name: str,
    seconds: float,
    prom: LocalPrometheus | None = None,
) -> None:
    """--linger: everything stays up (the operator checked each second) for a look around.
    With --prometheus: until Ctrl-C (the expected end, no error) unless --linger is given, and
    Prometheus' URL printed with a few queries to try."""
    if prom is None and seconds <= 0:
        return
    if prom is None:
        console.print(
            f"lingering {seconds:.0f}s: KUBECONFIG={stack.kubeconfig} kubectl get md; "
            f"curl {summary['replicas'][0]['endpoint']}/v2/models/{name}"
        )
    else:
        _print_prometheus(console, stack, prom, seconds)
    end = time.monotonic() + seconds if seconds > 0 else math.inf
    try:
        while time.monotonic() < end:
            stack.check_operator()
            if prom is not None and (prom.proc is None or prom.proc.poll() is not None):
                raise RuntimeError(f"prometheus exited:\n{prom.log_tail()}")
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    except KeyboardInterrupt:
        if prom is None:
            raise
        console.print("stopping")


def _start_prometheus(console: Any, stack: LocalStack, state_dir: Path) -> LocalPrometheus:
    prom = LocalPrometheus(stack, state_dir / "prometheus")
    with console.status("starting Prometheus (Kubernetes service discovery)"):
        try:
            prom.up()
        except BaseException:  # the caller's teardown never sees it: stop what it started
            prom.down()
            raise
    console.print(f"[green]✓[/] Prometheus at {prom.url}")
    return prom


# What `demo --prometheus` suggests asking (the dashboard has the rest: helm/weightlift/dashboards).
EXAMPLE_QUERIES = (
    "sum by (role, loaded_from) (weightlift_replica_time_to_ready_seconds_count)",
    "weightlift_bytes_loaded",
    "sum by (verb, resource) (weightlift_api_requests_total)",
)


def _print_prometheus(
    console: Any, stack: LocalStack, prom: LocalPrometheus, seconds: float
) -> None:
    console.print(f"Prometheus keeps scraping at [bold]{prom.url}[/] (HTTP API; no web UI), e.g.")
    for q in EXAMPLE_QUERIES:
        console.print(
            f"  curl -s {prom.url}/api/v1/query --data-urlencode {shlex.quote('query=' + q)}"
        )
    console.print(
        f"KUBECONFIG={stack.kubeconfig} kubectl get md; "
        + (f"stopping in {seconds:.0f}s" if seconds > 0 else "Ctrl-C stops everything")
    )


def _scale_ups(console: Any, obs: Observer, replicas: int, timeout: float) -> list[ScaleUp]:
    with console.status("scale-ups: one served by the warm spare, then one cold"):
        return spare_then_cold(obs, replicas, timeout)


def _print_scale_ups(console: Any, summary: JSON, ups: list[ScaleUp]) -> None:
    from rich.table import Table

    # The cold start a scale-up is compared with: the source's, from storage.
    first = min(
        (
            r["secondsToReady"]
            for r in summary["replicas"]
            if r.get("role") == "Source" and r.get("secondsToReady")
        ),
        default=None,
    )
    table = Table(title="scale-ups: from the scale patch to the new replica Ready")
    for col in ("scale-up", "replica", "its spare's pod", "role", "loaded from", "ready s"):
        table.add_column(col)
    table.add_column("÷ source's")
    for u in ups:
        table.add_row(
            f"{u.from_replicas}→{u.to_replicas}, {u.kind}",
            u.replica,
            "yes (same UID)" if u.was_spare else "no (new pod)",
            u.role,
            u.loaded_from,
            f"{u.ready_s:.2f}",
            f"{u.ready_s / first:.2f}" if first else "-",
        )
    if first:
        table.caption = f"the source: {first:.1f}s from its pod's creation to Ready (storage)"
    console.print(table)


def _who(operator: JSON) -> str:
    if operator["installedBy"] == "helm":
        return (
            f"helm release {operator['release']}: pod {operator['namespace']}/{operator['pod']}"
            f" as ServiceAccount {operator['serviceAccount']}"
        )
    return f"local process {operator['pid']}"


def _prepare_vllm(console: Any, stack: LocalStack, model_dir: Path) -> JSON:
    """The vLLM environment (built on first use) and the tiny Llama; returns its probe."""
    from weightlift.local.llm import ensure_vllm_env, make_in_engine_env, vllm_python

    python = vllm_python()
    if python is None:
        with console.status("building the vLLM environment (once; minutes, about 6 GB)"):
            python = ensure_vllm_env()
    else:  # re-point its editable weightlift at this checkout (fast when it already is)
        with console.status("checking the vLLM environment"):
            ensure_vllm_env()
    with console.status("making the tiny Llama (HF layout, random weights, local tokenizer)"):
        probe = make_in_engine_env(python, model_dir)
        add_hook_library(model_dir)
    stack.worker_env.update({"WEIGHTLIFT_VLLM_PYTHON": str(python)})
    return probe


def _prepare_triton(console: Any, stack: LocalStack) -> None:
    """tritonserver and its Python backend stubs (unpacked once from nvidia-pytriton)."""
    from weightlift.local.llm import ensure_triton_env

    with console.status("checking the Triton install (once: unpacks nvidia-pytriton, ~140 MB)"):
        home = ensure_triton_env()
    stack.worker_env.update({"WEIGHTLIFT_TRITON_HOME": str(home)})


def _report(
    console: Any,
    summary: JSON,
    probe: JSON,
    name: str,
    json_out: Path | None,
    plot: Path | None,
    scale_ups: Callable[[], list[ScaleUp]] | None = None,
) -> None:
    """The tables, one more request through every endpoint, the scale-ups (--scale-up: after
    the rollout's tables, whose replicas and ratio stay the rollout's), then --json and --plot."""
    _print_summary(console, summary, probe, name)
    if scale_ups is not None:
        ups = scale_ups()
        summary["scaleUps"] = [u.as_json() for u in ups]
        _print_scale_ups(console, summary, ups)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    _draw(console, summary, plot, name)


def _draw(console: Any, summary: JSON, plot: Path | None, name: str) -> None:
    if plot is not None:
        from weightlift.local.demo_plot import plot_demo

        try:
            console.print(f"wrote {plot_demo(summary, plot, name)}")
        except RuntimeError as exc:  # matplotlib missing
            raise click.ClickException(str(exc)) from None


def _print_summary(console: Any, summary: JSON, probe: JSON, name: str) -> None:
    _print_tables(console, summary, name)
    _check_endpoints(console, summary, probe, name)


def _print_tables(console: Any, summary: JSON, name: str) -> None:
    from rich.table import Table

    table = Table(title=f"{name}: Ready in {summary['secondsToReady']:.1f}s")
    for col in (
        "replica",
        "role",
        "loaded from",
        "endpoint",
        "hooks",
        "load s",
        "GB/s",
        "compile",
        "created at",
        "standby at",
        "hand-off s",
        "ready at",
    ):
        table.add_column(col)

    def at(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else "-"

    for r in summary["replicas"]:
        table.add_row(
            r["name"],
            str(r["role"]),
            str(r["loadedFrom"]),
            str(r["endpoint"]),
            "ran" if r["hooksRun"] else "no",
            f"{r['loadSeconds']:.2f}" if r["loadSeconds"] is not None else "-",
            f"{r['gbps']:.2f}" if r["gbps"] is not None else "-",
            str(r.get("compileCache") or "-"),
            at(r.get("createdAt")),
            at(r.get("standbyAt")),
            f"{r['handoffSeconds']:.3f}" if r.get("handoffSeconds") is not None else "-",
            at(r.get("readyAt")),
        )
    table.caption = (
        "created / standby / ready at: seconds since the apply; hand-off: the operator's "
        "peers annotation (its watch event) to the waiting worker reading it"
    )
    if summary.get("afterSourceRatio") is not None:
        table.caption += (
            f"; source Ready at {summary['sourceReadyAt']:.1f}s, all at "
            f"{summary['readyAt']:.1f}s: (all - source) / source = "
            f"{summary['afterSourceRatio']:.2f}"
        )
    console.print(table)
    timeline = Table(title="where each replica's seconds went (s)")
    timeline.add_column("replica")
    for step, _ in TIMELINE_STEPS:
        timeline.add_column(step)
    timeline.add_column("total")
    timeline.add_column("peer transport (UCX)")
    for r in summary["replicas"]:
        steps = r.get("timeline") or {}
        timeline.add_row(
            r["name"],
            *(f"{steps[s]:.2f}" if s in steps else "-" for s, _ in TIMELINE_STEPS),
            f"{sum(steps.values()):.2f}",
            transports_text(r.get("transports") or []),
        )
    console.print(timeline)


def transports_text(transports: list[JSON]) -> str:
    """Each rank's peer transport, one per line ("-" for a replica that pulled nothing)."""
    lines = [
        f"r{t['rank']}: {t['transport']}" + (f" ({t['note']})" if t.get("note") else "")
        for t in transports
    ]
    return "\n".join(lines) or "-"


def _check_endpoints(console: Any, summary: JSON, probe: JSON, name: str) -> None:
    # One more real request through each endpoint: same input, same output everywhere.
    outputs = set()
    if "completion" in probe:
        kind = "OpenAI"
        for r in summary["replicas"]:
            with contextlib.suppress(httpx.HTTPError, KeyError, IndexError):
                if r.get("openaiEndpoint"):
                    outputs.add(complete(r["openaiEndpoint"], name, probe["completion"]))
                elif r.get("tritonEndpoint"):
                    kind = "Triton generate"
                    outputs.add(generate(r["tritonEndpoint"], name, probe["completion"]))
        if outputs:
            same = "the expected" if outputs == {probe["completion"]["expectedText"]} else "OTHER"
            console.print(
                f"greedy completion through {len(summary['replicas'])} {kind} endpoints: "
                f"{same} text {sorted(outputs)!r}"
            )
        return
    for r in summary["replicas"]:
        if r["endpoint"]:
            with contextlib.suppress(httpx.HTTPError):
                out = infer(r["endpoint"], name, probe["request"])
                outputs.add(json.dumps(out.get("outputs", []), sort_keys=True))
    if outputs:
        same = "identical" if len(outputs) == 1 else f"{len(outputs)} DIFFERENT"
        console.print(f"inference through {len(summary['replicas'])} endpoints: {same} outputs")
