"""The worker's whole life on the device, as a pod would live it: a real `weightlift worker`
process (builtin runtime, the demo model with its init hook, plan device "cuda" or "cpu") must
call its init hook with the pod-local device index, serve on the device and pass the inference
probe; then a target worker pulls the weights from it over P2P into the same kind of memory and
must answer the same requests with the same bytes. Started through `worker_command()` rather
than `weightlift worker`: on a bare GPU host the project is on PYTHONPATH, not pip-installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import httpx

from weightlift.bench.gpu_limits import JSON

WORKER_COMMAND = [
    sys.executable,
    "-c",
    "from weightlift.worker.main import worker_command; worker_command()",
]
HOOK = "hooks/libinit.so"
HOOK_ENV = "WEIGHTLIFT_BENCH_HOOK_LIBRARY"


def _plan(model: Path, pod: str, device: str, source: bool, peers: list[Any], hook: bool) -> Any:
    from weightlift.api.model import InitHooks, Role
    from weightlift.bench.p2p_worker import worker_plan
    from weightlift.local.net import free_port

    return worker_plan(
        model,
        pod,
        free_port(),
        Role.SOURCE if source else Role.TARGET,
        peers,
        ranks=1,
        device=device,
        identity="bench-gpu-identity",
        init_hooks=InitHooks(library=HOOK) if hook else None,
        transfer_timeout_seconds=60,
    )


def requests_for(model: Path) -> list[JSON]:
    """The probe's request and a second one with other numbers (every answer compared)."""
    probe = json.loads((model / "probe.json").read_text())
    first: JSON = probe["request"]
    second = json.loads(json.dumps(first))
    for inp in second["inputs"]:
        inp["data"] = [round(0.5 * x - 0.25, 6) for x in inp["data"]]
    return [first, second]


def answers(client: httpx.Client, url: str, requests: list[JSON]) -> list[Any] | str:
    """Each request's outputs as served (JSON numbers: float32 values round-trip exactly)."""
    out = []
    for body in requests:
        r = client.post(f"{url}/v2/models/bench/infer", json=body, timeout=60)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        out.append([(o["name"], o["shape"], o["data"]) for o in r.json()["outputs"]])
    return out


def gpu_memory_mib(pid: int) -> int | None:
    """GPU memory a process holds, as nvidia-smi lists it; None where it cannot tell (no
    nvidia-smi, or a PID namespace it does not list). Shown, not judged: that the plan's device
    "cuda" was served on is the worker's own doing (it fails without a GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    q = [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1])
    return None


def hook_indices(log: Path) -> list[int]:
    """Device indices the demo hook was initialised with ("init DIR INDEX HANDLE" lines)."""
    if not log.exists():
        return []
    return [int(ln.split()[2]) for ln in log.read_text().splitlines() if ln.startswith("init ")]


def _prebuilt_hook(model: Path) -> bool:
    """The demo hook built elsewhere (hack/gpu-wheels.sh builds one for x86-64 Linux), for a
    host without gcc: $WEIGHTLIFT_BENCH_HOOK_LIBRARY."""
    built = os.environ.get(HOOK_ENV)
    if not built or not Path(built).is_file():
        return False
    (model / HOOK).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built, model / HOOK)
    return True


def _check_worker(
    proc: Any, client: httpx.Client, model: Path, hook_log: Path | None, timeout: float
) -> JSON:
    from weightlift.bench.p2p_worker import _infer_ok

    st = proc.wait_phase(client, timeout=timeout)
    out: JSON = {
        "phase": st["phase"],
        "message": st.get("message", "")[:400],
        "strategy": st.get("strategy"),
        "loaded_from": st.get("loadedFrom"),
        "load_seconds": st.get("loadSeconds"),
        "gbps": st.get("gbps"),
        "load_phases": st.get("loadPhases") or {},
    }
    if st["phase"] != "Serving":
        return out
    if hook_log is not None:
        reported = [h["deviceIndex"] for h in st.get("hooks", [])]
        out["hook_device_index"] = {"reported": reported, "called": hook_indices(hook_log)}
        out["hook_ok"] = reported == [0] and hook_indices(hook_log) == [0]
    out["probe_ok"] = _infer_ok(client, proc.url, model)
    out["gpu_memory_mib"] = gpu_memory_mib(proc.p.pid)
    return out


def run_lifecycle(workdir: Path, device: str, size_mb: float, timeout: float = 600) -> JSON:
    from weightlift.api.worker import PeerCandidate
    from weightlift.bench.p2p_worker import WorkerProc
    from weightlift.local.models import make_demo
    from weightlift.worker.p2p.nixl_compat import nixl_import_error

    model = workdir / "lifecycle-model"
    hook = True
    out: JSON = {"device": device, "size_mb": size_mb}
    try:
        make_demo(model, size_mb, tp=1, hook=True)
    except click.ClickException as exc:  # no gcc on this host
        make_demo(model, size_mb, tp=1, hook=False)
        hook = _prebuilt_hook(model)
        if not hook:
            out["hook_note"] = f"init hook not checked: {exc.message}"
    requests = requests_for(model)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with httpx.Client() as client:
        src_log = workdir / "hook-source.log"
        src = WorkerProc(
            _plan(model, "gpu-life-src", device, True, [], hook),
            workdir,
            {**env, "WEIGHTLIFT_HOOK_LOG": str(src_log)},
            command=WORKER_COMMAND,
        )
        try:
            out["source"] = _check_worker(src, client, model, src_log if hook else None, timeout)
            if out["source"]["phase"] != "Serving":
                out["source"]["log"] = src.lines[-30:]
                return _verdict(out)
            src_answers = answers(client, src.url, requests)
            out["source"]["answers_ok"] = isinstance(src_answers, list)
            why = nixl_import_error()
            if why is not None:
                out["target"] = {"skipped": f"NIXL not importable: {why}"[:400]}
                return _verdict(out)
            src.wait_published(client)
            cand = PeerCandidate(pod="gpu-life-src", address=f"127.0.0.1:{src.plan.runtime.port}")
            tgt_log = workdir / "hook-target.log"
            tgt = WorkerProc(
                _plan(model, "gpu-life-tgt", device, False, [cand], hook),
                workdir,
                {**env, "WEIGHTLIFT_HOOK_LOG": str(tgt_log)},
                command=WORKER_COMMAND,
            )
            try:
                t = _check_worker(tgt, client, model, tgt_log if hook else None, timeout)
                if t["phase"] == "Serving":
                    t["from_peer"] = str(t["loaded_from"]).startswith("peer:")
                    t["same_answers"] = answers(client, tgt.url, requests) == src_answers
                else:
                    t["log"] = tgt.lines[-30:]
                out["target"] = t
            finally:
                tgt.kill()
        finally:
            src.kill()
    return _verdict(out)


def _verdict(out: JSON) -> JSON:
    """Passed: the source served on the device (hook, probe, answers) and the target, where it
    ran, pulled from the peer and answered the same bytes."""
    src = out.get("source", {})
    ok = src.get("phase") == "Serving" and src.get("probe_ok") and src.get("answers_ok")
    if "hook_ok" in src:
        ok = ok and src["hook_ok"]
    tgt = out.get("target", {})
    if "skipped" not in tgt:
        ok = ok and tgt.get("phase") == "Serving" and tgt.get("probe_ok") is True
        ok = ok and tgt.get("from_peer") is True and tgt.get("same_answers") is True
        if "hook_ok" in tgt:
            ok = ok and tgt["hook_ok"]
    out["passed"] = bool(ok)
    return out
