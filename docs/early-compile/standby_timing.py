"""A warm spare's hand-off to Ready, with and without compile-first (issue 33 item 3).

Run with the project's python from the repository root (the vLLM environment built):

    python docs/early-compile/standby_timing.py [--hidden 256 --layers 2]

A storage source (compiled mode) starts and becomes Ready. Then, one after the other, a standby
target with compile-first on (the default) and one with it off (WEIGHTLIFT_VLLM_COMPILE_FIRST=0)
start and wait in Standby as a warm spare does. Each has its own empty vLLM cache root, so the
first compiles on its own before the hand-off, and the second installs the source's cache after
it. Once a target is in Standby and its engine no longer changes (compile-first: vLLM answers
/health; compile-after: 10 s in Standby, its engine waits at the weight step), the hand-off
names the source. (A first version handed compile-first off after 10 s as well, in the middle
of its own cold compile: 30.2 s to Ready against 7.4 s with the cache after the hand-off; see
README.) The script prints the seconds from
the hand-off to the worker's Ready and to its first completion, and whether both targets' greedy
outputs (top-5 logprobs) equal the source's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from weightlift.api.model import Role
from weightlift.api.worker import PEERS_FILE_ENV, PeerCandidate, PeerHandoff
from weightlift.bench.vllm import _stop, finish_worker, start_worker
from weightlift.local.llm import make_in_engine_env, vllm_python
from weightlift.local.stack import vllm_engine_args
from weightlift.worker.engines.vllm.ranks import COMPILE_FIRST_ENV

PROMPTS = ["hello world", "the quick brown fox", "one two three four five six seven"]


def greedy(address: str, prompt: str) -> Any:
    body = {"model": "llm", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5}
    resp = httpx.post(f"http://{address}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["logprobs"]


def status(address: str) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = httpx.get(f"http://{address}/weightlift/v1/status", timeout=5).json()
        return doc
    except (httpx.HTTPError, ValueError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    opts = ap.parse_args()
    python = vllm_python()
    assert python is not None, "build the vLLM environment first (make vllm-env)"
    work = Path(tempfile.mkdtemp(prefix="wl-early-compile-"))
    model = work / "model"
    make_in_engine_env(python, model, hidden=opts.hidden, layers=opts.layers)
    args = vllm_engine_args(eager=False)
    src = start_worker(python, model, work, Role.SOURCE, [], args, "source")
    running = [src.proc]
    rows: dict[str, Any] = {}
    try:
        srow, _ = finish_worker(src, 1800)
        rows["source"] = {"ready_s": round(srow["ready_s"], 2)}
        reference = [greedy(src.address, p) for p in PROMPTS]
        for mode, flag in (("compile-first", "1"), ("compile-after", "0")):
            handoff = work / f"{mode}.peers.json"
            handoff.write_text("")
            env = {PEERS_FILE_ENV: str(handoff), COMPILE_FIRST_ENV: flag}
            tgt = start_worker(python, model, work, Role.TARGET, [], args, mode, **env)
            running.append(tgt.proc)
            plan = json.loads((work / f"{tgt.pod}.json").read_text())
            engine = f"http://127.0.0.1:{plan['runtime']['enginePort']}"
            standby_since = None
            while True:
                assert tgt.proc.poll() is None, tgt.log.read_text()[-3000:]
                if status(tgt.address).get("phase") == "Standby":
                    standby_since = standby_since or time.monotonic()
                    try:
                        up = httpx.get(engine + "/health", timeout=5).status_code == 200
                    except httpx.HTTPError:
                        up = False
                    # compile-first: until vLLM is up (compiled, warmed up); compile-after: its
                    # engine waits at the weight step, 10 s in Standby is enough.
                    if up if flag == "1" else time.monotonic() - standby_since > 10:
                        break
                time.sleep(0.2)
            staged = handoff.with_suffix(".tmp")
            staged.write_text(
                PeerHandoff(peers=[PeerCandidate(pod=src.pod, address=src.address)]).to_text()
            )
            t0 = time.monotonic()
            staged.replace(handoff)
            trow, _ = finish_worker(tgt, 1800)
            ready = trow["ready_at"] - t0
            outputs = [greedy(tgt.address, p) for p in PROMPTS[:1]]
            first = time.monotonic() - t0
            outputs += [greedy(tgt.address, p) for p in PROMPTS[1:]]
            rows[mode] = {
                "handoff_to_ready_s": round(ready, 2),
                "handoff_to_first_completion_s": round(first, 2),
                "compile_cache": trow["compile_cache"],
                "loaded_from": trow["from"],
                "bit_identical_to_source": outputs == reference,
            }
            _stop(tgt.proc)
            running.remove(tgt.proc)
    finally:
        for proc in running:
            _stop(proc)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
