"""The Open Inference Protocol's REST spec, fuzzed (schemathesis's generators) against a real
builtin `weightlift worker` serving a tiny model: a fixed sequence from `weightlift bench oip`
finds no failure. In its own process: schemathesis patches hypothesis process-wide once it
builds a strategy, which must not reach this suite's other hypothesis tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.worker import make_plan, running_worker
from weightlift.bench.oip import spec, status_problem
from weightlift.local.models import DemoModel
from weightlift.worker.engines.builtin.runtime import InferError
from weightlift.worker.engines.builtin.v2codec import decode_inputs

EXAMPLES = 40  # per sweep: ~250 requests, seconds once the worker serves

INFER = "POST /v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer"
META = "GET /v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}"


def test_a_seeded_fuzz_of_the_oip_spec_finds_no_failure(
    demo_tp1: DemoModel, tmp_path: Path
) -> None:
    out = tmp_path / "oip.json"
    argv = [sys.executable, "-m", "weightlift", "bench", "oip", "--examples", str(EXAMPLES)]
    argv += ["--seed", "0", "--model", str(demo_tp1.out), "--json", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    counts = json.loads(out.read_text())
    assert counts["failures"] == 0, counts["examples"]
    assert "5" not in {s[0] for s in counts["by_status"]}
    # Every route of the spec was reached, and the sequence reaches each kind of answer: the
    # model's own request (200), generated tensors it refuses (400), unknown models (404).
    ops = counts["by_operation"]
    routes = {f"{m.upper()} {p}" for p, item in spec()["paths"].items() for m in item}
    assert set(ops) == routes - {f"PARAMETERS {p}" for p in spec()["paths"]}
    assert {"200", "400", "404"} <= set(ops[INFER]), ops[INFER]
    assert {"200", "404"} <= set(ops[META]), ops[META]


def test_statuses_the_spec_does_not_declare_are_4xx_with_its_error_object() -> None:
    """The check can fail: what the fuzz counts as nonconformance."""
    error = json.dumps({"error": "unknown model 'x'"}).encode()
    assert status_problem(200, {"200"}, b"{}") is None
    assert status_problem(400, {"200", "400"}, error) is None
    assert status_problem(404, {"200"}, error) is None  # "an HTTP error status (typically 400)"
    assert status_problem(404, {"200"}, b"404: Not Found") is not None  # no error object
    assert status_problem(400, {"200", "400"}, b'{"error": 3}') is not None
    assert status_problem(503, {"200"}, error) is not None  # not a 4xx
    assert status_problem(302, {"200"}, b"") is not None


# What the fuzz found (500s before): a value out of its datatype's range, and an input of
# another datatype than the model's reaching the program.


@pytest.mark.parametrize(
    ("datatype", "value"), [("UINT8", -1), ("INT8", 300), ("INT64", 2**70), ("UINT64", -1)]
)
def test_a_value_out_of_its_datatypes_range_is_refused_naming_the_input(
    datatype: str, value: int
) -> None:
    item = {"name": "x", "shape": [1], "datatype": datatype, "data": [value]}
    with pytest.raises(InferError, match=r"^input 'x': .*(bounds|too large)"):
        decode_inputs(json.dumps({"inputs": [item]}).encode(), None)


def test_a_refusal_names_the_input_once() -> None:
    item = {"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}
    with pytest.raises(InferError) as refused:
        decode_inputs(json.dumps({"inputs": [item]}).encode(), None)
    assert str(refused.value) == "input 'x': 1 values, shape [2] needs 2"


def test_infer_refuses_what_the_fuzz_found_with_400(demo_tp1: DemoModel) -> None:
    d = demo_tp1.d_model
    with running_worker(make_plan(demo_tp1.out)) as w:
        assert w.wait_phase({"Serving", "Failed"})["phase"] == "Serving"
        with httpx.Client(base_url=w.url, timeout=30) as c:

            def infer(datatype: str, shape: list[int], data: list[float]) -> httpx.Response:
                item = {"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}
                return c.post("/v2/models/demo/infer", json={"inputs": [item]})

            for datatype in ("INT8", "BOOL", "INT64"):  # the program is FP32
                r = infer(datatype, [0, d], [])
                assert r.status_code == 400, r.text
                assert r.json() == {
                    "error": f"input 'INPUT0' has datatype {datatype}, model expects FP32"
                }
            r = infer("UINT8", [1, d], [-1] * d)
            assert r.status_code == 400 and "out of bounds for uint8" in r.json()["error"]
            # Any floating datatype is still cast to the weights' dtype.
            for datatype in ("FP16", "FP32", "FP64"):
                r = infer(datatype, [1, d], [0.5] * d)
                assert r.status_code == 200, r.text
                assert r.json()["outputs"][0]["shape"] == [1, d]
