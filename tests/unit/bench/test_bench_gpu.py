"""`weightlift bench gpu` on a host without CUDA: its CPU parts run end to end (~30 s here, on 2
busy cores), in processes where the Kubernetes client and kopf cannot be imported and weightlift
is not pip-installed (what a bare GPU host has); plus its goal verdicts and cache checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import weightlift
from weightlift.bench.gpu_checksum import run_checksums
from weightlift.bench.gpu_limits import cached_fraction
from weightlift.bench.gpu_loaders import summarize_drops
from weightlift.bench.gpu_report import goals
from weightlift.worker.p2p import manifest
from weightlift.worker.p2p.nixl_compat import nixl_import_error

REPO = Path(weightlift.__file__).resolve().parents[1]

# Put first on PYTHONPATH: every process of the run (the bench, its loaders in fresh processes,
# the P2P peers, the workers) starts with it. FORBIDDEN must never be tried (each try is logged);
# ABSENT is what the GPU host of hack/gpu-bench.sh lacks besides (its image's package list against
# this venv's): importing it fails there, so it fails here too.
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, os, sys

    FORBIDDEN = {"kubernetes", "kubernetes_asyncio", "kopf"}
    ABSENT = {
        "boto3", "botocore", "s3transfer", "jmespath", "cryptography", "cffi", "sniffio",
        "tritonclient", "oauthlib", "requests_oauthlib", "websocket", "durationpy",
        "pythonjsonlogger", "gevent", "greenlet", "brotli", "truststore", "iso8601",
        "aiohttp_retry", "schemathesis", "kmock", "runai_model_streamer_s3",
    }

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in FORBIDDEN:
                with open(os.environ["WL_BLOCKED_LOG"], "a") as f:
                    f.write(name + "\\n")
            if top in FORBIDDEN or top in ABSENT:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    """
)


def test_cpu_parts_run_without_kubernetes_or_install(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    blocked = tmp_path / "blocked.log"
    out = tmp_path / "gpu.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}{os.pathsep}{REPO}",
        "WL_BLOCKED_LOG": str(blocked),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path, also where the test host has a GPU
    }
    argv = ["--json", str(out), "--loader", "weightlift-preload", "--loader", "safetensors"]
    argv += ["--first-loader", "weightlift-preload", "--workdir", str(tmp_path / "work")]
    run = subprocess.run(
        [sys.executable, "-c", "from weightlift.bench.gpu import main; main()", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no CUDA here" in run.stderr
    assert not blocked.exists(), blocked.read_text()
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and "goals" not in doc
    assert not any("error" in doc[k] for k in ("limits", "loaders", "p2p", "checksums"))
    assert doc["limits"]["memcpy_gbps"] > 0 and "cuda" in doc["limits"]
    ours = doc["loaders"]["results"]["weightlift-preload"]
    assert ours["warm"]["verified"] and ours["cold"]["verified"] and ours["cold"]["gbps"] > 0
    assert doc["first_in_process"]["weightlift-preload"]["verified"]
    kinds = doc["checksums"]["kinds"]
    assert kinds["xxh3"]["gbps"] > 0 and kinds["crc32"]["gbps"] > 0
    assert "gbps" in kinds["dev64"] or kinds["dev64"]["skipped"] == "dev64 not available"
    life = doc["lifecycle"]
    assert life["source"]["hook_device_index"] == {"reported": [0], "called": [0]}
    assert life["source"]["probe_ok"] and life["passed"], life
    if nixl_import_error() is None:
        p2p = doc["p2p"]
        assert p2p["verified"] and p2p["loaded_from"] == ["peer:gpu-src-0"], p2p
        assert set(p2p["phases"]) >= {"manifest", "agent", "transfer", "verify"}
        assert life["target"]["from_peer"] and life["target"]["same_answers"], life
    assert "weightlift bench gpu" in run.stdout and "limits" in run.stdout


def _doc(p2p: float, transport: str, dev64: float, warm: float, first: float, cold: float) -> dict:
    peer = {"warm": {"gbps": 1.0, "verified": True}, "cold": {"gbps": 1.5, "verified": True}}
    return {
        "limits": {"h2d_pinned": {"gbps": 50.0}, "odirect_read_gbps": 2.0},
        "loaders": {
            "results": {
                "weightlift-preload": {"warm": {"gbps": warm}, "cold": {"gbps": cold}},
                "safetensors": peer,
            },
            "cold_drop": {"note": "dropped"},
        },
        "first_in_process": {"weightlift-preload": {"gbps": first}},
        "p2p": {"gbps": p2p, "transport": transport, "ucx_read_transports": [], "verified": True},
        "checksums": {"kinds": {"dev64": {"gbps": dev64}}, "agreement": {"equal": True}},
        "lifecycle": {"passed": True},
    }


def test_goals_pass_at_the_targets_and_fail_below() -> None:
    passing = goals(_doc(50.0, "cuda_ipc", 500.0, 45.0, 40.0, 2.0))
    assert [g["passed"] for g in passing] == [True] * 7, passing
    failing = goals(_doc(49.9, "cuda_ipc", 499.0, 44.9, 39.9, 1.9))
    assert [g["passed"] for g in failing] == [False, False, False, False, False, True, True]
    # Fast enough but not over cuda_ipc: the P2P goal names the transport and fails.
    tcp = goals(_doc(80.0, "tcp/lo", 600.0, 45.0, 40.0, 2.0))[0]
    assert tcp["passed"] is False and "tcp/lo" in tcp["note"]


def test_goals_unmeasured_are_neither_pass_nor_fail() -> None:
    doc = _doc(50.0, "cuda_ipc", 500.0, 45.0, 40.0, 2.0)
    doc["checksums"] = {"kinds": {"dev64": {"skipped": "dev64 not available"}}}
    del doc["first_in_process"]
    verdicts = {g["goal"].split(" (")[0]: g["passed"] for g in goals(doc)}
    assert verdicts["device checksum dev64"] is None
    assert verdicts["preload first in a fresh process"] is None


def test_cold_runs_say_when_the_cache_was_not_dropped(tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(1 << 20))
    f.read_bytes()
    assert (cached_fraction([f]) or 0.0) > 0.9  # just read: resident (tmpfs too)
    kept = summarize_drops(
        [{"dropped": True, "cached_after": 0.0}, {"dropped": False, "cached_after": 0.7}]
    )
    assert kept["dropped"] is False and kept["max_cached_after"] == 0.7
    assert "could not drop" in kept["note"]
    unknown = summarize_drops([{"dropped": None, "cached_after": None}])
    assert unknown["dropped"] is None and "could not check" in unknown["note"]


def test_a_device_kind_is_timed_once_checksum_knows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before devsum lands, dev64 is "not available"; once `checksum` knows it, it is timed."""
    real = manifest.checksum

    def with_dev64(tensor: torch.Tensor, kind: str = "xxh3") -> str:
        return real(tensor, "crc32" if kind == "dev64" else kind)  # type: ignore[arg-type]

    before = run_checksums(torch.device("cpu"), 1 << 20, 1)["kinds"]["dev64"]
    monkeypatch.setattr(manifest, "checksum", with_dev64)
    after = run_checksums(torch.device("cpu"), 1 << 20, 1)
    assert "gbps" in before or before == {"skipped": "dev64 not available"}
    assert after["kinds"]["dev64"]["gbps"] > 0 and after["kinds"]["xxh3"]["gbps"] > 0
    assert "device kernel was not run" in after["agreement"]["note"]
