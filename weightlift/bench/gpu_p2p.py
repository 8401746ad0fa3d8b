"""P2P between two processes on the device, as `bench p2p --processes peer` runs it: a source
process loads the model from storage onto the device and publishes it (SourcePublisher), a target
process pulls it (PeerToPeerLoader, every checksum verified) `repeat` times, each pull checked
bit for bit against `safetensors.load_file`. Reported: end-to-end GB/s (median of the pulls after
the first; the first, with its agent set-up, apart), the pull's phases, and the transport UCX
used: as the pull records it (`PullResult.transport`, where this build has it) and as UCX itself
prints it with UCX_PROTO_INFO=y."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue

from weightlift.bench.gpu_limits import JSON
from weightlift.bench.ucxinfo import read_transports


class PeerProc:
    """`python -m weightlift.bench.peer ...`: JSON events from its stdout, every other line (UCX's
    own output, logs) kept as its log; always killed with its process group."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "weightlift.bench.peer", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.events: Queue[JSON | None] = Queue()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.log.append(line.rstrip())
                continue
            if isinstance(event, dict) and "event" in event:
                self.events.put(event)
            else:
                self.log.append(line.rstrip())
        self.events.put(None)

    def wait_for(self, names: set[str], timeout: float) -> JSON:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except Empty:
                raise RuntimeError(f"no {sorted(names)} event after {timeout}s") from None
            if event is None:
                raise RuntimeError("peer process exited: " + "\n".join(self.log[-20:]))
            if event["event"] in names:
                return event

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=30)
        self._reader.join(timeout=5)


def run_p2p(model: Path, workdir: Path, device: str, repeat: int, timeout: float = 600) -> JSON:
    from weightlift.api.worker import PeerCandidate
    from weightlift.local.sharded import make_plan
    from weightlift.worker.p2p.nixl_compat import nixl_import_error

    why = nixl_import_error()
    if why is not None:
        return {"skipped": f"NIXL not importable: {why}"[:400]}
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}
    src_plan = workdir / "p2p-source.json"
    # A slow transport (UCX's software emulation of GPU memory: ~0.4 GB/s) must still finish.
    timeout_s = 120
    src = make_plan(model, pod="gpu-src-0", tensor_parallel=1, transfer_timeout_seconds=timeout_s)
    src_plan.write_text(src.model_dump_json())
    source = PeerProc(["serve", "--plan", str(src_plan), "--device", device], env)
    try:
        ready = source.wait_for({"ready"}, timeout)
        cand = PeerCandidate(pod="gpu-src-0", address=f"127.0.0.1:{ready['port']}")
        tgt_plan = workdir / "p2p-target.json"
        plan = make_plan(
            model,
            pod="gpu-tgt-0",
            tensor_parallel=1,
            peers=[cand],
            transfer_timeout_seconds=timeout_s,
        )
        tgt_plan.write_text(plan.model_dump_json())
        target = PeerProc(
            [
                *("pull", "--plan", str(tgt_plan), "--repeat", str(repeat)),
                *("--check", str(model), "--device", device),
            ],
            {**env, "UCX_PROTO_INFO": "y"},
        )
        try:
            runs = []
            while True:
                event = target.wait_for({"repeat", "done"}, timeout)
                runs.append(event)
                if event["event"] == "done":
                    break
        finally:
            target.kill()
    finally:
        source.kill()
    return summarize(runs, ready, read_transports("\n".join(target.log)))


def summarize(runs: list[JSON], ready: JSON, ucx_reads: list[str]) -> JSON:
    warm = runs[1:] or runs
    seconds = statistics.median(r["seconds"] for r in warm)
    nbytes = runs[0]["bytes"]
    ranks: list[JSON] = [rk for r in warm for rk in r["ranks"]]
    phase_names = dict.fromkeys(k for rk in ranks for k in rk.get("phases", {}))
    phases = {k: statistics.median(rk["phases"].get(k, 0.0) for rk in ranks) for k in phase_names}
    transports = sorted({str(rk.get("transport")) for rk in ranks if rk.get("transport")})
    return {
        "gbps": round(nbytes / seconds / 1e9, 3),
        "seconds": round(seconds, 4),
        "min_gbps": round(nbytes / max(r["seconds"] for r in warm) / 1e9, 3),
        "max_gbps": round(nbytes / min(r["seconds"] for r in warm) / 1e9, 3),
        "first_pull_seconds": round(runs[0]["seconds"], 4),
        "bytes": nbytes,
        "pulls": len(runs),
        "verified": all(r["ok"] for r in runs),
        "loaded_from": sorted({str(rk.get("loaded_from")) for r in runs for rk in r["ranks"]}),
        "phases": {k: round(v, 4) for k, v in phases.items()},
        "transport": ", ".join(transports) if transports else "unknown",
        "ucx_read_transports": ucx_reads,
        "source_load_seconds": round(float(ready.get("load_seconds", 0.0)), 3),
        "source_publish_seconds": round(float(ready.get("publish_seconds", 0.0)), 3),
    }
