"""`weightlift bench p2p` with real `weightlift worker` processes (the default mode).

A source worker loads a `weightlift model make-demo` model (2 ranks) from storage, serves it and
publishes it; target workers (role Target, strategy PeerToPeer) pull it and serve. Numbers come
from the workers' own /weightlift/v1/status (loadSeconds, bytesLoaded, loadedFrom). The fault
run kills the source when the target's status first shows bytes loaded, and reads the moment of
the fallback from the target's log line "P2P failed (...); falling back to storage".

That fault target runs the same worker (`run_worker`) through this module's entry point,
`python -m weightlift.bench.p2p_worker --plan P --batch-mb MB --throttle-s S`, which hands it
explicit pull options (small, throttled READs) that `weightlift worker` never takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.api.model import (
    InitHooks,
    LoadingSpec,
    LoadStrategy,
    ModelSource,
    PeerToPeerOptions,
    Role,
    RuntimeSpec,
)
from weightlift.api.worker import (
    PEERS_FILE_ENV,
    PeerCandidate,
    PeerHandoff,
    WorkerPhase,
    WorkerPlan,
)
from weightlift.bench.load import drop_cache
from weightlift.local.net import free_port
from weightlift.worker.loaders.p2p import options_for
from weightlift.worker.main import LOG_FORMAT, run_worker

RANKS = 2
# The fault run's target moves small, throttled READ batches: the kill lands mid-transfer.
FAULT_BATCH_MB = 4
_FALLBACK_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING .*P2P failed")


def worker_plan(
    model: Path,
    pod: str,
    port: int,
    role: Role,
    peers: list[PeerCandidate],
    max_in_flight: int = 8,
    *,
    ranks: int = RANKS,
    device: str = "cpu",
    identity: str = "bench-identity",
    init_hooks: InitHooks | None = None,
    transfer_timeout_seconds: int = 10,
) -> WorkerPlan:
    """A bench worker's plan: a Source loads from storage, a Target pulls from `peers`."""
    return WorkerPlan(
        deployment="bench",
        pod_name=pod,
        model_identity=identity,
        model=ModelSource(uri=f"file://{model}"),
        model_dir=str(model),
        served_model_name="bench",
        tensor_parallel=ranks,
        ranks=list(range(ranks)),
        device=device,
        role=role,
        peers=peers,
        host="127.0.0.1",
        init_hooks=init_hooks,
        runtime=RuntimeSpec(port=port),
        loading=LoadingSpec(
            strategy=LoadStrategy.PEER_TO_PEER if role == Role.TARGET else LoadStrategy.AUTO,
            peer_to_peer=PeerToPeerOptions(
                transfer_timeout_seconds=transfer_timeout_seconds, max_in_flight=max_in_flight
            ),
        ),
    )


class WorkerProc:
    """A `weightlift worker` process (with `throttle_s`, this module's entry point running the
    same worker with small throttled READs; `command`: another way to start the worker, e.g.
    where weightlift is not pip-installed); its log is collected in a thread; always killed."""

    def __init__(
        self,
        plan: WorkerPlan,
        workdir: Path,
        env: dict[str, str],
        throttle_s: float | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.plan = plan
        path = workdir / f"{plan.pod_name}.json"
        path.write_text(plan.model_dump_json())
        self.url = f"http://127.0.0.1:{plan.runtime.port}"
        self.log_path = workdir / f"{plan.pod_name}.log"
        self.lines: list[str] = []
        argv = [*(command or [sys.executable, "-m", "weightlift", "worker"]), "--plan", str(path)]
        if throttle_s is not None:
            argv = [sys.executable, "-m", "weightlift.bench.p2p_worker", "--plan", str(path)]
            argv += ["--batch-mb", str(FAULT_BATCH_MB), "--throttle-s", str(throttle_s)]
        self.p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "WEIGHTLIFT_FAIL_LINGER_SECONDS": "0"},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def status(self, client: httpx.Client) -> dict[str, Any] | None:
        try:
            r = client.get(f"{self.url}/weightlift/v1/status", timeout=1.0)
            return dict(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def wait_phase(
        self,
        client: httpx.Client,
        timeout: float = 600,
        phases: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """The status once the worker is in one of `phases`, Serving or Failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(client)
            if st and st.get("phase") in (*phases, "Serving", "Failed"):
                return st
            if self.p.poll() is not None:
                raise click.ClickException(
                    f"worker {self.plan.pod_name} exited: " + "\n".join(self.lines[-30:])
                )
            time.sleep(0.05)
        raise click.ClickException(
            f"worker {self.plan.pod_name} not {'/'.join((*phases, 'Serving'))} after {timeout}s"
        )

    def wait_published(self, client: httpx.Client, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if client.get(f"{self.url}/weightlift/v1/p2p/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise click.ClickException(f"{self.plan.pod_name} did not publish as a P2P source")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=30)
        self._reader.join(timeout=5)
        self.log_path.write_text("\n".join(self.lines) + "\n")


def _infer_ok(client: httpx.Client, url: str, model: Path) -> bool:
    """The demo model's probe request gives the expected output (the weights are really right)."""
    probe_path = model / "probe.json"
    if not probe_path.exists():
        return True
    probe = json.loads(probe_path.read_text())
    r = client.post(f"{url}/v2/models/bench/infer", json=probe["request"], timeout=30)
    if r.status_code != 200:
        return False
    outputs = {o["name"]: o for o in r.json().get("outputs", [])}
    tol = float(probe.get("tolerance", 1e-3))
    for want in probe.get("expectedOutputs", []):
        got = outputs.get(want["name"])
        if got is None or len(got["data"]) != len(want["data"]):
            return False
        for a, b in zip(got["data"], want["data"], strict=True):
            if abs(a - b) > tol * max(1.0, abs(b)):
                return False
    return True


def run_workers(
    model: Path,
    files: list[Path],
    workdir: Path,
    env: dict[str, str],
    repeat: int,
    throttle_s: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {"processes": "weightlift worker (source) + weightlift worker (target)"}
    with httpx.Client() as client:
        out["storage_worker"] = _storage_loads(model, files, workdir, env, client, repeat)
        src = WorkerProc(
            worker_plan(model, "bench-src-0", free_port(), Role.SOURCE, []), workdir, env
        )
        try:
            st = src.wait_phase(client)
            if st["phase"] != "Serving":
                raise click.ClickException(f"source failed: {st.get('message')}")
            src.wait_published(client)
            out["source_load"] = {
                "gbps": st.get("gbps"),
                "seconds": st.get("loadSeconds"),
                "strategy": st.get("strategy"),
                "loaded_from": st.get("loadedFrom"),
            }
            cand = PeerCandidate(pod="bench-src-0", address=f"127.0.0.1:{src.plan.runtime.port}")
            runs = [
                _pull(model, workdir, env, client, cand, f"bench-tgt-{i}") for i in range(repeat)
            ]
            standby = [
                _pull(model, workdir, env, client, cand, f"bench-sby-{i}", standby=True)
                for i in range(repeat)
            ]
        finally:
            src.kill()
        out["p2p"] = _summary(runs)
        out["p2p_standby"] = _summary(standby)
        out["fault"] = _fault(model, workdir, env, throttle_s, client)
    return out


def _storage_loads(
    model: Path,
    files: list[Path],
    workdir: Path,
    env: dict[str, str],
    client: httpx.Client,
    repeat: int,
) -> dict[str, Any]:
    """Source workers loading from storage with a cold page cache: the storage side measured
    as the P2P side is, a worker's own loadSeconds (its program opening beside the load)."""
    runs = []
    for i in range(repeat):
        drop_cache(files)
        worker = WorkerProc(
            worker_plan(model, f"bench-sto-{i}", free_port(), Role.SOURCE, []), workdir, env
        )
        try:
            st = worker.wait_phase(client)
            if st["phase"] != "Serving":
                raise click.ClickException(f"storage load failed: {st.get('message')}")
            ready = _since_start(st.get("timeline") or {}).get("serving")
            runs.append({"seconds": st["loadSeconds"], "bytes": st["bytesLoaded"], "ready": ready})
        finally:
            worker.kill()
    seconds = statistics.median(r["seconds"] for r in runs)
    return {
        "gbps": runs[0]["bytes"] / seconds / 1e9,
        "seconds": seconds,
        "cache": "cold",
        "runs": [r["seconds"] for r in runs],
        "ready_seconds": _median_ready([r["ready"] for r in runs]),
        "loader": "weightlift worker (Source)",
    }


def _pull(
    model: Path,
    workdir: Path,
    env: dict[str, str],
    client: httpx.Client,
    cand: PeerCandidate,
    pod: str,
    standby: bool = False,
) -> dict[str, Any]:
    """One target worker pulling from `cand`. With `standby`, it starts with no peers and a
    hand-off file (as a pod created before its source is Ready), reserves and faults in its
    pull buffers, waits in Standby, and is handed `cand` then: the pull lands in memory
    already faulted in."""
    peers = [] if standby else [cand]
    handoff = workdir / f"{pod}.peers"
    worker_env = env
    if standby:
        handoff.write_text("")
        worker_env = {**env, PEERS_FILE_ENV: str(handoff)}
    tgt = WorkerProc(worker_plan(model, pod, free_port(), Role.TARGET, peers), workdir, worker_env)
    try:
        if standby:
            tgt.wait_phase(client, phases=(WorkerPhase.STANDBY.value,))
            # Replaced whole, as the kubelet swaps a projected file: never read half written.
            staged = handoff.with_suffix(".staged")
            staged.write_text(PeerHandoff(peers=[cand]).to_text())
            staged.replace(handoff)
        st = tgt.wait_phase(client)
        ok = st["phase"] == "Serving" and _infer_ok(client, tgt.url, model)
        return {
            "seconds": st.get("loadSeconds"),
            "bytes": st.get("bytesLoaded"),
            "loaded_from": st.get("loadedFrom"),
            "strategy": st.get("strategy"),
            "phase": st["phase"],
            "inference_ok": ok,
            "phases": st.get("loadPhases") or {},
            # seconds since the process started: server, hooks, (standby,) load, serving
            "timeline": _since_start(st.get("timeline") or {}),
        }
    finally:
        tgt.kill()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median load and its phases over the runs that served; verified when every run served
    the right answers from the peer."""
    good = [r for r in runs if r["phase"] == "Serving" and r["seconds"]]
    seconds = statistics.median(r["seconds"] for r in good) if good else float("nan")
    nbytes = good[0]["bytes"] if good else 0
    return {
        "gbps": nbytes / seconds / 1e9 if good else 0.0,
        "seconds": seconds,
        "verified": bool(good)
        and len(good) == len(runs)
        and all(r["inference_ok"] and str(r["loaded_from"]).startswith("peer:") for r in runs),
        "ranks": RANKS,
        "bytes": nbytes,
        "runs": runs,
        "ready_seconds": _median_ready([r["timeline"].get("serving") for r in good]),
        "phases": {
            k: statistics.median(r["phases"].get(k, 0.0) for r in good)
            for k in dict.fromkeys(k for r in good for k in r["phases"])
        },
    }


def _median_ready(seconds: list[float | None]) -> float | None:
    """Median seconds from the worker process's start to Serving: the time to Ready a user
    sees of the pod (imports, server, hooks, load, program open), of the runs that report it."""
    ready = [s for s in seconds if s is not None]
    return statistics.median(ready) if ready else None


def _since_start(timeline: dict[str, float]) -> dict[str, float]:
    start = timeline.get("process")
    if start is None:
        return {}
    return {k: round(t - start, 3) for k, t in timeline.items() if k != "process"}


def _log_time(line: str) -> float | None:
    m = _FALLBACK_LINE.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _fault(
    model: Path, workdir: Path, env: dict[str, str], throttle_s: float, client: httpx.Client
) -> dict[str, Any]:
    src = WorkerProc(
        worker_plan(model, "bench-doomed-0", free_port(), Role.SOURCE, []), workdir, env
    )
    killed_wall: float | None = None
    killed_mono: float | None = None
    try:
        src.wait_phase(client)
        src.wait_published(client)
        cand = PeerCandidate(pod="bench-doomed-0", address=f"127.0.0.1:{src.plan.runtime.port}")
        tgt = WorkerProc(
            worker_plan(model, "bench-tgt-f", free_port(), Role.TARGET, [cand], max_in_flight=1),
            workdir,
            env,
            throttle_s=throttle_s,
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and killed_wall is None:
                st = tgt.status(client)
                if st and st.get("phase") == "Loading" and st.get("bytesLoaded", 0) > 0:
                    killed_wall, killed_mono = time.time(), time.monotonic()
                    src.kill()
                elif st and st.get("phase") in ("Serving", "Failed"):
                    break
                time.sleep(0.005)
            st = tgt.wait_phase(client)
            serving_mono = time.monotonic()
            ok = st["phase"] == "Serving" and _infer_ok(client, tgt.url, model)
            time.sleep(0.2)  # let the log reader catch up
            fallback_times = [t for t in map(_log_time, tgt.lines) if t is not None]
            messages = [ln for ln in tgt.lines if "P2P failed" in ln]
        finally:
            tgt.kill()
    finally:
        src.kill()
    fell_back = str(st.get("loadedFrom", "")).startswith("storage")
    return {
        "source_killed": killed_wall is not None,
        "fell_back": fell_back,
        "verified": ok and fell_back,
        "seconds_to_fallback": (max(fallback_times) - killed_wall)
        if fallback_times and killed_wall is not None
        else None,
        "seconds_to_serving": serving_mono - killed_mono if killed_mono is not None else None,
        "loaded_from": [str(st.get("loadedFrom"))],
        "peer_failures": [m.split("P2P failed", 1)[1][:400] for m in messages],
        "throttle_s": throttle_s,
    }


def main(argv: list[str] | None = None) -> int:
    """A worker with explicit pull options (the fault run's target)."""
    parser = argparse.ArgumentParser(prog="python -m weightlift.bench.p2p_worker")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--batch-mb", type=float, required=True)
    parser.add_argument("--throttle-s", type=float, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    plan = WorkerPlan.from_file(args.plan)
    opts = options_for(plan, batch_bytes=int(args.batch_mb * (1 << 20)), throttle_s=args.throttle_s)
    return asyncio.run(run_worker(plan, pull_options=opts))


if __name__ == "__main__":
    raise SystemExit(main())
