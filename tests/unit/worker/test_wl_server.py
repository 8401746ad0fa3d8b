"""The worker over real HTTP: KServe v2 with httpx and tritonclient.http, status, metrics, P2P
extension point, failures, and a real `weightlift worker` process stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from tests.support.worker import copy_model, make_plan, plan_env, running_worker
from weightlift.local.models import DemoModel, build_hook_library
from weightlift.worker.engines.builtin.engine import BuiltinEngine
from weightlift.worker.server import set_p2p_handler

SLOW_HOOK = r"""
#include <unistd.h>
void *triton_pytorch_model_init(const char *model_dir, int device_index) {
    usleep(1500000);
    return 0;
}
"""


def probe(model_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((model_dir / "probe.json").read_text())
    return doc


def test_kserve_v2_with_httpx(demo_tp2: DemoModel, tmp_path: Path) -> None:
    hook_log = tmp_path / "hook.log"
    os.environ["WEIGHTLIFT_HOOK_LOG"] = str(hook_log)
    try:
        plan = make_plan(demo_tp2.out, tp=2, initHooks={"library": "hooks/libinit.so"})
        with running_worker(plan) as w:
            st = w.wait_phase({"Serving", "Failed"})
            assert st["phase"] == "Serving", st
            assert st["strategy"] == "preload" and st["loadedFrom"] == "storage:file"
            assert st["bytesLoaded"] == st["bytesTotal"] == demo_tp2.bytes_total
            assert st["hooksRun"] and [h["deviceIndex"] for h in st["hooks"]] == [0, 1]
            assert st["gbps"] > 0 and st["loadSeconds"] > 0 and st["ranks"] == [0, 1]
            c = httpx.Client(base_url=w.url, timeout=10)
            assert c.get("/v2/health/live").status_code == 200
            assert c.get("/v2/health/ready").status_code == 200
            assert c.get("/v2/models/demo/ready").status_code == 200
            meta = c.get("/v2/models/demo").json()
            assert meta["inputs"] == [
                {"name": "INPUT0", "datatype": "FP32", "shape": [-1, demo_tp2.d_model]}
            ]
            assert meta["outputs"][0]["name"] == "OUTPUT0"
            p = probe(demo_tp2.out)
            r = c.post("/v2/models/demo/infer", json=dict(p["request"], id="req-7"))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"] == "req-7" and body["model_name"] == "demo"
            out = body["outputs"][0]
            assert out["shape"] == [2, demo_tp2.d_model] and out["datatype"] == "FP32"
            np.testing.assert_allclose(out["data"], p["expectedOutputs"][0]["data"], atol=1e-5)
            # errors are 4xx with a message, never 500
            assert c.get("/v2/models/other").status_code == 404
            assert c.get("/v2/models/demo/versions/2").status_code == 404
            bad = c.post(
                "/v2/models/demo/infer",
                json={
                    "inputs": [
                        {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}
                    ]
                },
            )
            assert bad.status_code == 400 and "shape" in bad.json()["error"]
            assert c.post("/v2/models/demo/infer", content=b"{nope").status_code == 400
            short = c.post(
                "/v2/models/demo/infer",
                json={
                    "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1]}]
                },
            )
            assert short.status_code == 400
            metrics = c.get("/metrics").text
            values = {
                s.name: s.value
                for f in text_string_to_metric_families(metrics)
                for s in f.samples
                if not s.labels
            }
            assert values["weightlift_bytes_loaded"] == demo_tp2.bytes_total, values
            assert 'weightlift_inference_requests_total{model="demo",status="ok"} 1.0' in metrics
            assert 'status="bad_request"} 3.0' in metrics
            assert "weightlift_ready 1.0" in metrics
            # P2P extension point: 503 until the publisher is installed, then forwarded to it
            # (which refuses a manifest request that names no identity and rank).
            reply = c.get("/weightlift/v1/p2p/manifest")
            assert reply.status_code in (400, 503), reply.text
            if reply.status_code == 400:
                assert "rank" in reply.text
        assert w.exit_code == 0
        calls = hook_log.read_text().split("\n")
        assert [c.split()[0] for c in calls if c] == ["init", "init", "release", "release"]
    finally:
        os.environ.pop("WEIGHTLIFT_HOOK_LOG", None)


def test_tritonclient_http(demo_tp1: DemoModel) -> None:
    with running_worker(make_plan(demo_tp1.out)) as w:
        assert w.wait_phase({"Serving", "Failed"})["phase"] == "Serving"
        client = triton.InferenceServerClient(url=w.url.removeprefix("http://"))
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("demo")
        md = client.get_model_metadata("demo")
        assert md["inputs"][0]["name"] == "INPUT0"
        p = probe(demo_tp1.out)
        x = np.array(p["request"]["inputs"][0]["data"], dtype=np.float32).reshape(2, -1)
        expected = np.array(p["expectedOutputs"][0]["data"], dtype=np.float32).reshape(2, -1)
        for binary_in in (True, False):
            for binary_out in (True, False):
                inp = triton.InferInput("INPUT0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary_in)
                outs = [triton.InferRequestedOutput("OUTPUT0", binary_data=binary_out)]
                res = client.infer("demo", [inp], outputs=outs)
                np.testing.assert_allclose(res.as_numpy("OUTPUT0"), expected, atol=1e-5)
        # default request (no outputs listed): tritonclient asks for binary outputs
        inp = triton.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(
            client.infer("demo", [inp]).as_numpy("OUTPUT0"), expected, atol=1e-5
        )
        client.close()


class FakePublisher:
    def __init__(self) -> None:
        self.closed = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"tail": request.match_info["tail"], "method": request.method})

    def close(self) -> None:
        self.closed = True


def test_p2p_extension_point(demo_tp1: DemoModel) -> None:
    with running_worker(make_plan(demo_tp1.out)) as w:
        w.wait_phase({"Serving"})
        assert w.worker is not None and w.worker.runner is not None
        deadline = time.monotonic() + 30
        while not w.worker.published and time.monotonic() < deadline:
            time.sleep(0.05)
        app = w.worker.runner.app
        set_p2p_handler(app, None)
        r = httpx.get(w.url + "/weightlift/v1/p2p/rank/0/manifest")
        assert r.status_code == 503 and "not a source yet" in r.text
        fake = FakePublisher()
        set_p2p_handler(app, fake)
        assert isinstance(w.worker.engine, BuiltinEngine)
        w.worker.engine.publisher = fake  # type: ignore[assignment]
        r = httpx.post(w.url + "/weightlift/v1/p2p/sessions", json={})
        assert r.json() == {"tail": "sessions", "method": "POST"}
        assert httpx.delete(w.url + "/weightlift/v1/p2p/sessions/x").json()["method"] == "DELETE"
    assert fake.closed


def test_server_answers_during_init_hooks(demo_tp1: DemoModel, tmp_path: Path) -> None:
    d = copy_model(demo_tp1.out, tmp_path / "m")
    build_hook_library(d / "hooks" / "libslow.so", SLOW_HOOK)
    plan = make_plan(d, initHooks={"library": "hooks/libslow.so"})
    with running_worker(plan) as w:
        st = w.wait_phase({"InitHooks"}, timeout=10)
        assert st["phase"] == "InitHooks" and not st["hooksRun"]
        assert httpx.get(w.url + "/v2/health/live").status_code == 200
        assert httpx.get(w.url + "/v2/health/ready").status_code == 503
        r = httpx.post(w.url + "/v2/models/demo/infer", json=probe(d)["request"])
        assert r.status_code == 503
        assert w.wait_phase({"Serving"})["hooksRun"]


@pytest.mark.parametrize("case", ["truncated", "missing_symbol", "missing_tensor", "extra_tensor"])
def test_load_failures_keep_status_up(
    case: str, demo_tp1: DemoModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = copy_model(demo_tp1.out, tmp_path / "m")
    term = tmp_path / "termination-log"
    monkeypatch.setenv("WEIGHTLIFT_TERMINATION_LOG", str(term))
    monkeypatch.setenv("WEIGHTLIFT_FAIL_LINGER_SECONDS", "30")
    extra: dict[str, Any] = {}
    st_file = d / "model.safetensors"
    if case == "truncated":
        st_file.write_bytes(st_file.read_bytes()[:-1000])
        needle, perm = "model.safetensors: tensor 'layers.", True
    elif case == "missing_symbol":
        build_hook_library(d / "hooks" / "libbad.so", "int nothing(void) { return 0; }\n")
        extra["initHooks"] = {"library": "hooks/libbad.so"}
        needle, perm = "lacks symbol triton_pytorch_model_init", True
    else:
        t = load_file(str(st_file))
        if case == "missing_tensor":
            del t["layers.1.down.weight"]
            needle = "'layers.1.down.weight' needed by model.pt2 is missing"
        else:
            t["unused.bias"] = np.zeros(1, np.float32) if False else t["layers.0.up.bias"].clone()
            needle = "'unused.bias' is not used by model.pt2"
        save_file(t, str(st_file))
        perm = True
    with running_worker(make_plan(d, **extra)) as w:
        st = w.wait_phase({"Failed", "Serving"})
        assert st["phase"] == "Failed"
        assert needle in st["message"] and st["permanentFailure"] is perm
        if case != "missing_symbol":
            assert str(d) in st["message"] or "model.safetensors" in st["message"]
        assert httpx.get(w.url + "/v2/health/live").status_code == 200
        assert httpx.get(w.url + "/v2/health/ready").status_code == 503
        assert needle in term.read_text()
        t0 = time.monotonic()
    assert w.exit_code == 1 and time.monotonic() - t0 < 10  # SIGTERM-equivalent ends the linger


def test_failure_exits_after_linger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTLIFT_FAIL_LINGER_SECONDS", "0.3")
    monkeypatch.setenv("WEIGHTLIFT_TERMINATION_LOG", str(tmp_path / "t"))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 4)
    with running_worker(make_plan(tmp_path)) as w:
        w.thread.join(15)
        assert not w.thread.is_alive() and w.exit_code == 1
    assert "model" in (tmp_path / "t").read_text()


def test_worker_process_sigterm(demo_tp1: DemoModel, tmp_path: Path) -> None:
    plan = make_plan(demo_tp1.out, initHooks={"library": "hooks/libinit.so"})
    hook_log = tmp_path / "hook.log"
    env = {**os.environ, **plan_env(plan, tmp_path), "WEIGHTLIFT_HOOK_LOG": str(hook_log)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightlift", "worker"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{plan.runtime.port}"
        # A readiness wait, not a speed check: imports crawl on a busy 2-core box.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        else:
            raise AssertionError("worker never became ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = hook_log.read_text().split()
    assert lines.count("init") == 1 and lines.count("release") == 1
