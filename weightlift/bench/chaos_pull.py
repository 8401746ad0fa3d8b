"""Chaos scenarios that strike while a Target pulls its weights from a peer.

Since standby a Target's pull of the demo model lasts about 0.1 s: a harness that polls the
status for a Target in Loading beside a Ready source misses it, waits out its deadline and
never injects anything. So these scenarios arm the process node's fault gate
(worker/p2p/faultgate.py) before they deploy: the first Target to pull holds once its first
READ has landed, with READs still to go and its peer session open, and writes where it stands.
The harness waits for that file (it stays until released: no window to miss), checks that the
pull really is mid-transfer, strikes (SIGKILL or SIGSTOP the peer it reads from, or loses the
node), releases the hold, and once converged checks that the fault hit that pull: the Target
dropped its peer and got its weights elsewhere (the watcher checks they answer right), or the
node loss replaced it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

from weightlift.bench.chaos_run import Run
from weightlift.worker.p2p import faultgate


def held_pull(run: Run) -> faultgate.Held:
    """Wait until a Target of this deployment holds its pull; where it stands."""
    found: list[faultgate.Held] = []

    def holding() -> bool:
        held = faultgate.holding(run.gate, run.name)
        if held is not None:
            found.append(held)
        return held is not None

    run.wait("a target holding its pull open (fault gate)", holding)
    held = found[-1]
    assert held.in_flight, f"{held.pod} holds outside a transfer: {held}"
    uids = run.pod_uids()
    run.notes.update(held=held, held_uid=uids.get(held.pod))
    return held


@contextlib.contextmanager
def pulling(run: Run, replicas: int) -> Iterator[faultgate.Held]:
    """Deploy `replicas` with the gate armed; inside the block a Target holds its pull open
    mid-transfer (the fault goes there); leaving the block releases it."""
    faultgate.arm(run.gate, run.name)
    try:
        run.deploy(replicas=replicas)
        held = held_pull(run)
        run.fault_at = time.monotonic()
        yield held
    finally:
        faultgate.disarm(run.gate, run.name)


def _signal_pod(run: Run, pod: str, sig: signal.Signals) -> None:
    pids = run.stack.node.pids().get(f"{run.stack.namespace}/{pod}")
    assert pids, f"{pod} has no process on the node"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def peer_signalled(sig: signal.Signals, stopped_for: float) -> Callable[[Run], None]:
    """Three replicas; the peer a Target reads from gets `sig` mid-pull (a SIGSTOP lasts
    `stopped_for` seconds, the pull held meanwhile so its liveness check sees the peer frozen)."""

    def inject(run: Run) -> None:
        with pulling(run, 3) as held:
            _signal_pod(run, held.peer, sig)
            if sig == signal.SIGSTOP:
                time.sleep(stopped_for)
        if sig == signal.SIGSTOP:
            _signal_pod(run, held.peer, signal.SIGCONT)

    return inject


def verify_peer_fault(run: Run) -> str:
    """The held Target let go of its peer mid-pull and loaded elsewhere (verified weights: its
    own checksums, then the watcher's probes)."""
    held: faultgate.Held = run.notes["held"]
    log = run.pod_log(held.pod, run.notes["held_uid"])
    assert f"peer {held.peer}:" in log, f"{held.pod}'s log names no failure of {held.peer}"
    row = run.row(held.pod)
    got = str(row.get("loadedFrom"))
    assert got != f"peer:{held.peer}", f"{held.pod} still loaded from {held.peer} ({got})"
    failure = [line for line in log.splitlines() if f"peer {held.peer}:" in line][-1]
    why = failure.split(f"peer {held.peer}:", 1)[1].split(";")[0].strip()
    return (
        f"{held.pod} held at READ {held.done}/{held.batches} from {held.peer}; "
        f"{why[:60]}; loaded {got}"
    )


def verify_held(run: Run) -> str:
    """Where the pull stood when the fault struck (the mid-rollout faults check no more)."""
    held: faultgate.Held = run.notes["held"]
    return f"struck while {held.pod} held at READ {held.done}/{held.batches} from {held.peer}"


def node_lost(run: Run) -> None:
    """Two replicas; the node is lost (every worker process killed, the Node deleted) while the
    Target pulls, and a fresh one rejoins under the same name."""
    with pulling(run, 2):
        run.notes["pids"] = run.worker_pids()
        run.stack.replace_node(down_seconds=3.0)


def verify_node_lost(run: Run) -> str:
    """Every worker process that was pulling or serving when the node went died with it; the
    rejoined node runs the pods again (as a rebooted kubelet does: same pods, new processes)."""
    held: faultgate.Held = run.notes["held"]
    before: set[int] = run.notes["pids"]
    assert held.pid in before, f"the held worker {held.pid} was not {held.pod}'s process"
    survivors = before & run.worker_pids()
    assert not survivors, f"worker processes {sorted(survivors)} outlived the node"
    loaded = ", ".join(f"{r['name']}<-{r.get('loadedFrom')}" for r in run.replicas())
    return f"{held.pod} held at READ {held.done}/{held.batches}; after the node: {loaded}"
