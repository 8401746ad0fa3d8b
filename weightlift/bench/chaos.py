"""`weightlift bench chaos`: fault scenarios against the real local stack, each ending in a check.

One LocalStack (control plane, process node, operator: local/stack.py) runs every scenario in turn.
A scenario applies a ModelDeployment, injects its fault (SIGKILL the operator, restart the
kube-apiserver, corrupt a file, a hook library that crashes; faults while a Target pulls, held
open by the node's fault gate: bench/chaos_pull.py; faults while Targets wait in Standby:
bench/chaos_standby.py; faults while warm spares wait: bench/chaos_spares.py; faults to replicas
of several pods, LeaderWorkerSet groups: bench/chaos_groups.py) and then waits
for convergence: the right number of replicas Ready (and of warm spares waiting) with
`observedGeneration` caught up and exactly those pods and worker processes, or, for broken
inputs, no replica Ready and a status that names what is wrong and where. Meanwhile a watcher
(bench/chaos_run.py) sends the probe request to every replica the status calls Ready and
compares the answer with the expected output of the right weights: a replica that answers
otherwise counts as wrong weights served. After each scenario the deployment is deleted and
every worker process started since the scenario began must be gone (orphans).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from weightlift.bench import chaos_failover as failover
from weightlift.bench import chaos_groups as groups
from weightlift.bench import chaos_node as node
from weightlift.bench import chaos_pull as pull
from weightlift.bench import chaos_spares as spares
from weightlift.bench import chaos_standby as standby
from weightlift.bench import chaos_store as store
from weightlift.bench.chaos_models import (
    Models,
    lying_header_length,
    nan_weights,
    overlapping_offsets,
    truncate,
)
from weightlift.bench.chaos_run import (
    CONVERGE_TIMEOUT,
    Run,
    ScenarioSkipped,
    WeightsWatch,
    worker_processes,
)
from weightlift.local.kube import KUBE_ERRORS, describe
from weightlift.local.llm import ensure_vllm_env, vllm_python
from weightlift.local.models import build_hook_library
from weightlift.local.nodekind import NODE_KINDS, NodeKindName
from weightlift.local.stack import LocalStack
from weightlift.worker.p2p import faultgate

GONE_TIMEOUT = 120.0
# What ends a scenario unconverged (reported, not raised).
SCENARIO_ERRORS: tuple[type[Exception], ...] = (
    OSError,  # TimeoutError among them; a file a scenario could not write
    RuntimeError,
    *KUBE_ERRORS,
    AssertionError,
)

SEGFAULT_HOOK = """
#include <stddef.h>
void* triton_pytorch_model_init(const char* model_dir, int device) {
    (void)model_dir; (void)device;
    volatile int* p = NULL;
    *p = 1;
    return NULL;
}
"""
HANGING_HOOK = """
#include <unistd.h>
void* triton_pytorch_model_init(const char* model_dir, int device) {
    (void)model_dir; (void)device;
    for (;;) pause();
    return 0;
}
"""


# ----------------------------------------------------------------------------- scenarios


@dataclass
class Result:
    scenario: str
    converged: bool
    seconds: float | None
    orphans: int
    wrong_weights: int
    detail: str
    skipped: bool = False  # its fault could not be injected here (the detail says why)


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Run], None]
    replicas: int = 1  # Ready at the end (0: deleted or refused)
    refuses: str | None = None  # broken input: the status must name this; never Ready
    fast: bool = False  # in `make test`'s subset
    # After convergence: checks what the scenario is about (AssertionError: not converged) and
    # returns a line for the detail column.
    verify: Callable[[Run], str] | None = None
    spares: int = 0  # warm spares waiting at the end (spec.warmSpares)
    vllm: bool = False  # deploys vLLM replicas: the stack's workers need the vLLM environment
    pods: int = 1  # pods per replica: over 1, groups (the stack runs the LWS controller)
    timeout: float = CONVERGE_TIMEOUT  # for convergence, from the fault


# Faults mid-rollout strike while a Target holds its pull open (chaos_pull.pulling): a poll of
# the status for a replica "loading" can miss a load that lasts 0.1 s.
def _operator_killed(run: Run) -> None:
    with pull.pulling(run, 2):
        run.stack.kill_operator()
        time.sleep(2.0)
        run.fault_at = time.monotonic()
        run.stack.restart_operator()


def _apiserver_restarted(run: Run) -> None:
    with pull.pulling(run, 3):
        run.stack.restart_apiserver(down_seconds=3.0)


def _deleted_mid_load(run: Run) -> None:
    with pull.pulling(run, 3):
        run.stack.delete_md(run.name)


def _scale_flap(run: Run) -> None:
    """3 -> 0 with a pull held mid-transfer, then 3 again once the operator has acted on the 0
    (its pods on their way out), not after a guessed pause."""
    with pull.pulling(run, 3):
        run.scale(0)
        run.wait("the scale to 0 planned", run.planned)
        run.scale(3)


def _revision_twice(run: Run) -> None:
    """Revision 2's rollout is held mid-way (its source waits at the fault gate before its
    storage load: nothing of revision 2 can be Ready) when revision 3 lands; then let go."""
    run.deploy(replicas=2)
    run.wait("Ready", lambda: run.converged(2))
    faultgate.hold_at(run.gate, run.name, faultgate.STORAGE_LOAD)
    try:
        run.fault_at = time.monotonic()
        run.patch({"model": {"revision": "2"}})
        revision2 = _identity(run)
        run.wait("revision 2's source held before its load", lambda: bool(_held_of(run, revision2)))
        run.notes.update(held=_held_of(run, revision2), revision2=revision2)
        run.patch({"model": {"revision": "3"}})
        run.wait("revision 3 planned", run.planned)
    finally:
        faultgate.release_at(run.gate, run.name, faultgate.STORAGE_LOAD)


def _identity(run: Run) -> str:
    """The model identity the operator plans for now (its status, once it acted on the spec)."""
    run.wait("the spec planned", run.planned)
    md = run.stack.get_md(run.name) or {}
    return str((md.get("status") or {}).get("modelIdentity"))


def _held_of(run: Run, identity: str) -> list[str]:
    """The pods of `identity` waiting at the fault gate before their storage load."""
    at = faultgate.waiting_at(run.gate, run.name, faultgate.STORAGE_LOAD)
    return [a.pod for a in at if a.pod.startswith(f"{run.name}-{identity[:6]}-")]


def _verify_revision_twice(run: Run) -> str:
    """Where revision 2's rollout stood when revision 3 struck (this scenario checks no more)."""
    held = ", ".join(run.notes["held"])
    return f"revision 3 ({_identity(run)[:6]}) struck while {held} (revision 2) was held"


def _hook(source: str, lib: str) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        model = run.models.copy(run.name)
        build_hook_library(model / "hooks" / lib, source)
        run.fault_at = time.monotonic()
        run.deploy(model, replicas=1, hook_library=f"hooks/{lib}", load_timeout_seconds=30)

    return inject


def _corrupt(corrupt: Callable[[Path], str]) -> Callable[[Run], None]:
    def inject(run: Run) -> None:
        model = run.models.copy(run.name)
        corrupt(model)
        run.fault_at = time.monotonic()
        run.deploy(model, replicas=1)

    return inject


def _swapped_program(run: Run) -> None:
    model = run.models.copy(run.name)
    shutil.copy(run.models.other() / "model.pt2", model / "model.pt2")
    run.fault_at = time.monotonic()
    run.deploy(model, replicas=1)


SCENARIOS: tuple[Scenario, ...] = (
    # Up to node-lost-and-back (revision-changed-twice aside): faults that strike a Target's pull
    # held open mid-transfer by the node's fault gate (chaos_pull.py); revision-changed-twice
    # strikes while the gate holds revision 2's source before its storage load.
    Scenario(
        "operator-sigkill-mid-rollout", _operator_killed, 2, fast=True, verify=pull.verify_held
    ),
    Scenario(
        "source-sigkill-while-pulling",
        pull.peer_signalled(signal.SIGKILL, 0),
        replicas=3,
        fast=True,  # about 25 s here: `make test` sees a fault strike a pull mid-transfer
        verify=pull.verify_peer_fault,
    ),
    Scenario(
        "source-sigstop-while-pulling",
        pull.peer_signalled(signal.SIGSTOP, 20),
        replicas=3,
        verify=pull.verify_peer_fault,
    ),
    Scenario("apiserver-restart-while-loading", _apiserver_restarted, 3, verify=pull.verify_held),
    Scenario("deleted-mid-load", _deleted_mid_load, 0, fast=True, verify=pull.verify_held),
    Scenario("scale-3-0-3", _scale_flap, replicas=3, verify=pull.verify_held),
    Scenario("revision-changed-twice", _revision_twice, replicas=2, verify=_verify_revision_twice),
    Scenario("node-lost-and-back", pull.node_lost, replicas=2, verify=pull.verify_node_lost),
    Scenario("hook-segfaults", _hook(SEGFAULT_HOOK, "libsegv.so"), 0, "libsegv.so"),
    Scenario("hook-hangs", _hook(HANGING_HOOK, "libhang.so"), 0, "libhang.so"),
    Scenario("truncated-safetensors", _corrupt(truncate), 0, "model.safetensors", fast=True),
    Scenario("header-length-lying", _corrupt(lying_header_length), 0, "model.safetensors"),
    Scenario("overlapping-offsets", _corrupt(overlapping_offsets), 0, "model.safetensors"),
    Scenario("nan-weights", _corrupt(nan_weights), 0, "non-finite"),
    Scenario("swapped-model-pt2", _swapped_program, 0, "model.pt2"),
    # Faults while Targets wait in Standby (the source held at the fault gate before its load).
    Scenario(
        "standby-source-sigkill",
        standby.source_dies,
        replicas=3,
        fast=True,  # about 10 s here: `make test` sees a fault strike a deployment in standby
        verify=standby.verify_source_dies,
    ),
    Scenario(
        "standby-revision-changed",
        standby.revision_changes,
        replicas=2,
        verify=standby.verify_revision_changes,
    ),
    Scenario(
        "standby-wait-for-source-expires",
        standby.wait_expires,
        replicas=2,
        verify=standby.verify_wait_expires,
    ),
    Scenario(
        "standby-scale-down",
        standby.scale_down_in_standby,
        replicas=2,
        verify=standby.verify_scale_down,
    ),
    Scenario(
        "standby-foreign-peer-refused",
        standby.foreign_peer,
        replicas=2,
        verify=standby.verify_foreign_peer,
    ),
    # Faults while a warm spare waits (spec.warmSpares: 1): its node is lost, the scale
    # subresource races up and down, the revision changes (bench/chaos_spares.py).
    Scenario(
        "spare-node-lost",
        spares.spare_node_lost,
        replicas=1,
        spares=1,
        verify=spares.verify_spare_node_lost,
    ),
    Scenario(
        "spare-scale-race",
        spares.spare_scale_race,
        replicas=spares.RACE[-1],
        spares=1,
        verify=spares.verify_spare_scale_race,
    ),
    Scenario(
        "spare-revision-changed",
        spares.spare_revision_changed,
        replicas=1,
        spares=1,
        verify=spares.verify_spare_revision_changed,
    ),
    # vLLM's compile-cache store: an entry damaged, a store that cannot be written; the
    # replica compiles and is Ready anyway (bench/chaos_store.py). Minutes each: never fast.
    *(
        Scenario(name, inject, replicas=1, verify=verify, vllm=True, timeout=store.READY_TIMEOUT)
        for name, inject, verify in store.STORE_SCENARIOS
    ),
    # Two operators with leader election; the active one dies mid-rollout: the takeover time.
    Scenario(
        "leader-sigkill-standby-takes-over",
        failover.leader_killed,
        replicas=3,
        verify=failover.verify_leader_killed,
    ),
    # Replicas of 2 pods (LeaderWorkerSet groups, the real LWS controller): a source group's
    # pod killed mid-pull, a leader killed while its pods wait for it, LWS recreating a group,
    # a revision change while groups wait in Standby (bench/chaos_groups.py).
    *(
        Scenario(g.name, g.inject, g.replicas, fast=g.fast, verify=g.verify, pods=groups.PODS)
        for g in groups.SCENARIOS
    ),
)


# Faults only a real node has (bench/chaos_node.py): `--node kubelet` runs these instead.
NODE_SCENARIOS: tuple[Scenario, ...] = tuple(
    Scenario(f.name, f.inject, replicas=f.replicas, fast=f.fast, verify=f.verify)
    for f in node.FAULTS
)


def run_scenario(stack: LocalStack, models: Models, scenario: Scenario, index: int) -> Result:
    name = f"chaos{index}"
    before = worker_processes(os.getpid())
    watch = WeightsWatch(stack.kubeconfig, stack.namespace, name, models.probe)
    watch.never_ready = scenario.refuses is not None
    run = Run(stack, models, name, watch)
    watch.start()
    converged, seconds, detail, skipped = False, None, "", False
    try:
        scenario.inject(run)
        what = scenario.refuses
        if what is not None:
            run.wait(f"status naming {what!r}", lambda: run.refused(what), scenario.timeout)
        else:
            run.wait(
                f"{scenario.replicas} Ready, {scenario.spares} spare(s)",
                lambda: run.converged(scenario.replicas, scenario.spares, scenario.pods),
                scenario.timeout,
            )
        seconds = round(time.monotonic() - run.fault_at, 1)
        detail = run.status_text() if scenario.refuses else ""
        if scenario.verify is not None:
            detail = scenario.verify(run)
        converged = True
    except ScenarioSkipped as exc:
        detail, skipped = f"skipped: {exc}", True
    except SCENARIO_ERRORS as exc:
        detail = f"{describe(exc)} [{run.status_text()}]"
    finally:
        watch.stop()
        for cleanup in run.cleanups:
            cleanup()
        faultgate.disarm(run.gate, name)  # a hold left armed or held is no fault of the next
    orphans, left = _clean_up(run, before)
    if orphans:
        detail += f" [cleanup: {left}]"
    wrong = len(watch.wrong)
    return Result(scenario.name, converged, seconds, orphans, wrong, detail.strip(), skipped)


def _clean_up(run: Run, before: set[int]) -> tuple[int, str]:
    """Delete the deployment; count what is left after the deadline: pods, node runners and
    worker processes started during the scenario."""

    names = [run.name, *run.others]
    for name in names:
        with contextlib.suppress(*KUBE_ERRORS):
            if run.stack.get_md(name) is not None:
                run.stack.delete_md(name)
    deadline = time.monotonic() + GONE_TIMEOUT
    left: set[int] = set()
    while time.monotonic() < deadline:
        left = (worker_processes(os.getpid()) - before) | run.live_seen()
        pods = [p for n in names for p in run.stack.pods(n)]
        mds = [n for n in names if run.stack.get_md(n) is not None]
        if not left and not pods and not run._node_pods(*names) and not mds:
            return 0, "gone"
        time.sleep(0.5)
    pods = [p for n in names for p in run.stack.pods(n)]
    return len(left) + len(pods), f"left {len(left)} processes, {len(pods)} pods"


def scenario(name: str) -> tuple[int, Scenario]:
    """Its index (it names the deployment: chaos<index>) and the scenario."""
    for i, s in enumerate((*SCENARIOS, *NODE_SCENARIOS)):
        if s.name == name:
            return i, s
    raise KeyError(name)


def run_all(stack: LocalStack, models: Models, scenarios: list[Scenario]) -> list[Result]:
    results = []
    for s in scenarios:
        results.append(run_scenario(stack, models, s, scenario(s.name)[0]))
        click.echo(_row(results[-1]), err=True)
    return results


def _row(r: Result) -> str:
    secs = f"{r.seconds:.1f}" if r.seconds is not None else "-"
    return (
        f"{r.scenario:34} {_converged(r):9} {secs:>8} {r.orphans:>7} "
        f"{r.wrong_weights:>13}  {r.detail[:90]}"
    )


def _converged(r: Result) -> str:
    return "skipped" if r.skipped else ("yes" if r.converged else "NO")


def _passed(r: Result) -> bool:
    return (r.converged or r.skipped) and not r.orphans and not r.wrong_weights


def _repeats(results: list[Result]) -> list[str]:
    """A scenario run more than once: converged k/N, and its seconds' median and spread."""
    by_name: dict[str, list[Result]] = {}
    for r in results:
        by_name.setdefault(r.scenario, []).append(r)
    lines = []
    for name, runs in by_name.items():
        if len(runs) < 2:
            continue
        secs = sorted(r.seconds for r in runs if r.converged and r.seconds is not None)
        spread = (
            f"; seconds median {statistics.median(secs):.1f} ({secs[0]:.1f}-{secs[-1]:.1f})"
            if secs
            else ""
        )
        ok = sum(_passed(r) and not r.skipped for r in runs)
        lines.append(f"{name}: {ok}/{len(runs)} converged clean{spread}")
    return lines


def render(results: list[Result]) -> str:
    head = (
        f"{'scenario':34} {'converged':9} {'seconds':>8} {'orphans':>7} "
        f"{'wrong-weights':>13}  detail"
    )
    lines = [head, "-" * len(head)] + [_row(r) for r in results]
    ok = sum(r.converged for r in results)
    skipped = sum(r.skipped for r in results)
    lines.extend(_repeats(results))
    lines.append(
        f"{ok}/{len(results)} converged{f' ({skipped} skipped)' if skipped else ''}, "
        f"{sum(r.orphans for r in results)} orphans, "
        f"{sum(r.wrong_weights for r in results)} replicas served wrong weights"
    )
    return "\n".join(lines)


@click.command("chaos")
@click.option("--scenario", "only", multiple=True, help="Run only these (repeatable).")
@click.option("--fast", is_flag=True, help="Only the small subset `make test` runs.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/chaos"),
    show_default=True,
)
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run each picked scenario this many times in a row (a flake shows as k/N).",
)
@click.option(
    "--node",
    "node_kind",
    type=click.Choice(NODE_KINDS),
    default="process",
    show_default=True,
    help="kubelet: the faults only a real node has (root, `make node`, `make images`).",
)
def chaos_command(
    only: tuple[str, ...],
    fast: bool,
    json_out: Path | None,
    state_dir: Path,
    list_only: bool,
    repeat: int,
    node_kind: NodeKindName,
) -> None:
    """Fault scenarios on the real local stack: converged?, seconds, orphans, wrong weights."""
    catalogue = NODE_SCENARIOS if node_kind == "kubelet" else SCENARIOS
    if list_only:
        for s in catalogue:
            click.echo(s.name)
        return
    picked = [
        s
        for s in catalogue
        if (not only or s.name in only) and (not fast or s.fast)
        for _ in range(repeat)
    ]
    unknown = set(only) - {s.name for s in catalogue}
    if unknown:
        raise click.BadParameter(f"unknown scenarios {sorted(unknown)}", param_hint="--scenario")
    state_dir = state_dir.resolve()
    models = Models(state_dir / "models")
    worker_env = {"CUDA_VISIBLE_DEVICES": ""}
    if any(s.vllm for s in picked):  # built once, minutes (hack/install-vllm.sh)
        worker_env["WEIGHTLIFT_VLLM_PYTHON"] = str(vllm_python() or ensure_vllm_env())
    stack = LocalStack(
        state_dir / "stack",
        node_name="chaos-node",
        model_path_prefixes=(str(models.work),),
        worker_env=worker_env,
        with_lws=any(s.pods > 1 for s in picked),  # groups: hack/build-lws.sh (`make lws`)
        node_kind=node_kind,
    )
    with stack:
        if node_kind == "kubelet":
            node.prepare(stack)
        results = run_all(stack, models, picked)
    click.echo(render(results))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if not all(_passed(r) for r in results):
        raise SystemExit(1)
