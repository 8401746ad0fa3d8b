"""`weightlift bench oip`: the Open Inference Protocol's REST spec, fuzzed against a real worker.

The spec (bench/data/open_inference_rest.yaml, vendored from kserve/open-inference-protocol)
drives schemathesis's request generators (`APIOperation.as_strategy`, run under our own
hypothesis settings: seeded, no database, no shrinking) at a `weightlift worker` process serving
a tiny builtin demo model. Per operation: positive requests with the path naming the served model
and version (so infer bodies reach the model), negative ones (schema-invalid bodies) there too,
and positive requests with generated model names and versions (unknown ones). Then infer once
more from the spec narrowed to the model's names and the protocol's datatypes (`aimed`), so
bodies get past "unsupported datatype" into the codec, and the model's own probe request, which
must answer 200 with the spec's inference response.

Every answer is checked: no 5xx, a JSON content type where the spec gives one, the spec's
response schema for the statuses it declares, schema-invalid input refused with a 4xx, and any
other status an error status carrying the spec's error object (see `error_status`). Not checked:
schemathesis's "schema-valid requests are accepted" (the spec's inference_request admits any
tensor, the model only its own inputs: a 400 naming the mismatch is the spec's answer).

Runs in its own process (the unit test starts this command): schemathesis patches hypothesis
process-wide when it builds a strategy (a printer that prints nothing, another buffer size),
which must not reach the suite's other hypothesis tests.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import httpx
import yaml

from weightlift.api.model import ModelSource, RuntimeSpec
from weightlift.api.worker import WorkerPlan
from weightlift.local.net import free_port

if TYPE_CHECKING:
    from schemathesis import APIOperation, Case, CheckContext, Response
    from schemathesis.checks import CheckFunction

JSON = dict[str, Any]
SERVED = "oip"  # the served model name; the builtin runtime serves version "1" only
VERSION = "1"
KEPT_FAILURES = 10  # failure descriptions kept, each with a curl that repeats it
EXAMPLE_CHARS = 800  # generated bodies run to kilobytes: the start of each is enough to read
# The last line of a traceback in the worker's log: what a 500 hid.
_RAISED = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*$", re.M)


# inference_rest.md's "Tensor Data Types" table (the YAML types `datatype` as any string).
DATATYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip


def spec() -> JSON:
    """The vendored spec, its path templates made OpenAPI's: it writes `${MODEL_NAME}` (its
    markdown's placeholder), and a template is `{MODEL_NAME}`, so a fuzzer would send the `$`
    as part of every model name."""
    text = (files("weightlift.bench") / "data" / "open_inference_rest.yaml").read_text()
    doc: JSON = yaml.safe_load(text)
    doc["paths"] = {re.sub(r"\$\{(\w+)\}", r"{\1}", p): v for p, v in doc["paths"].items()}
    return doc


def aimed(doc: JSON, metadata: JSON) -> JSON:
    """The spec with the inference request narrowed to what reaches a model's codec: input and
    output names from the model's metadata, datatypes from the protocol's table, dimensions
    from the metadata's and a few small ones, flat data of numbers. Drawn from the spec as
    written, almost every request ends at "unsupported datatype" before its data is decoded."""
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    inputs, outputs = metadata.get("inputs", []), metadata.get("outputs", [])
    dims = sorted({0, 1, 2} | {d for t in inputs for d in t["shape"] if d >= 0})
    schemas["request_input"]["properties"].update(
        name={"type": "string", "enum": [t["name"] for t in inputs]},
        datatype={"type": "string", "enum": DATATYPES},
        shape={"type": "array", "items": {"type": "integer", "enum": dims}},
        data={"type": "array", "items": {"type": "number"}},
    )
    out_name = {"type": "string", "enum": [t["name"] for t in outputs]}
    schemas["request_output"]["properties"]["name"] = out_name
    return doc


@dataclass
class OipCounts:
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # "200": n
    by_operation: dict[str, dict[str, int]] = field(default_factory=dict)  # "GET /v2/": {...}
    failures: int = 0  # failed checks (a 500 fails two: server error, error status)
    by_failure: dict[str, int] = field(default_factory=dict)  # a check's title: n
    examples: list[str] = field(default_factory=list)
    worker_raised: dict[str, int] = field(default_factory=dict)  # a traceback's last line: n

    def count(self, operation: str, status: str) -> None:
        self.requests += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1
        per = self.by_operation.setdefault(operation, {})
        per[status] = per.get(status, 0) + 1

    def fail(self, title: str, example: str) -> None:
        self.failures += 1
        self.by_failure[title] = self.by_failure.get(title, 0) + 1
        if len(self.examples) < KEPT_FAILURES:
            self.examples.append(example[:EXAMPLE_CHARS])


def status_problem(status: int, declared: set[str], body: bytes) -> str | None:
    """What is wrong with an answer's status (None: nothing). The YAML declares 200 (and 400 for
    server metadata and infer) only; its prose (inference_rest.md) says a failed request "must
    be indicated by an HTTP error status (typically 400)" whose body is the error object. So a
    status the YAML does not declare must be a 4xx (404 for an unknown model, 405, 413, ...),
    and every error status must carry `{"error": "<message>"}`."""
    if str(status) not in declared and not 400 <= status < 500:
        return f"undeclared status {status} is not a 4xx error status"
    if status >= 400:
        try:
            doc = json.loads(body or b"")
        except ValueError:
            doc = None
        if not (isinstance(doc, dict) and isinstance(doc.get("error"), str)):
            return f"error status {status} without the spec's error object"
    return None


def error_status(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """`status_problem` as a schemathesis check: it stands in for status_code_conformance."""
    declared = {str(s) for s in case.operation.definition.raw.get("responses", {})}
    problem = status_problem(response.status_code, declared, response.content)
    if problem is not None:
        raise AssertionError(problem)
    return None


def _checks() -> list[CheckFunction]:
    from schemathesis import checks
    from schemathesis.specs.openapi import checks as oas

    return [
        checks.not_a_server_error,
        oas.content_type_conformance,
        oas.response_headers_conformance,
        oas.response_schema_conformance,
        oas.negative_data_rejection,
        error_status,
    ]


def _probe_request(model: Path) -> JSON:
    """The demo model's own valid request (written by `weightlift model make-demo`)."""
    doc: JSON = json.loads((model / "probe.json").read_text())["request"]
    return doc


def fuzz_oip(base_url: str, model: Path, n: int, seed: int | None = 0) -> OipCounts:
    """`n` generated requests per sweep (hypothesis stops early once a sweep's space is spent);
    `seed` None draws anew each run."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded
    from schemathesis import GenerationMode
    from schemathesis.errors import FailureGroup

    counts = OipCounts()
    checks = _checks()
    session = requests.Session()
    served = {"MODEL_NAME": SERVED, "MODEL_VERSION": VERSION}

    def send(case: Case) -> Response | None:
        label = case.operation.label
        try:
            r = case.call(base_url=base_url, session=session, timeout=30)
        except requests.RequestException as exc:
            counts.count(label, "no answer")
            counts.fail("no answer", f"{case.as_curl_command()}: {exc}")
            return None
        counts.count(label, str(r.status_code))
        try:
            case.validate_response(r, checks=checks)
        except FailureGroup as group:
            for failure in group.exceptions:
                title = getattr(failure, "title", None) or type(failure).__name__
                counts.fail(title, f"{case.as_curl_command()}\n  -> {r.status_code}: {failure}")
        return r

    def sweep(op: APIOperation, mode: GenerationMode, path: dict[str, str] | None) -> None:
        @settings(
            max_examples=n,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # counting, not shrinking
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode, path_parameters=path))
        def one(case: Case) -> None:
            send(case)

        if seed is not None:
            one = seeded(seed)(one)
        one()

    def load(doc: JSON) -> list[APIOperation]:
        schema = schemathesis.openapi.from_dict(doc, config=schemathesis.Config())
        methods = ("get", "put", "post", "delete", "patch", "head", "options")
        return [schema[p][m] for p, item in doc["paths"].items() for m in item if m in methods]

    ops = load(spec())
    for op in ops:
        templated = bool(op.path_parameters)
        sweep(op, GenerationMode.POSITIVE, served if templated else None)
        if op.body:  # a path's strings or no parameters at all: nothing to negate
            sweep(op, GenerationMode.NEGATIVE, served if templated else None)
        if templated:
            sweep(op, GenerationMode.POSITIVE, None)
    metadata = session.get(f"{base_url}/v2/models/{SERVED}").json()
    (infer,) = (op for op in load(aimed(spec(), metadata)) if op.method.upper() == "POST")
    sweep(infer, GenerationMode.POSITIVE, served)
    probe = infer.Case(path_parameters=served, body={**_probe_request(model), "id": "oip-probe"})
    r = send(probe)
    if r is not None and r.status_code != 200:
        counts.fail("probe refused", f"{probe.as_curl_command()}\n  -> {r.status_code}: {r.text}")
    return counts


def worker_plan(model: Path, port: int) -> WorkerPlan:
    return WorkerPlan(
        deployment="oip",
        pod_name="oip-0",
        model_identity="oip-identity",
        model=ModelSource(uri=f"file://{model}"),
        model_dir=str(model),
        served_model_name=SERVED,
        tensor_parallel=1,
        ranks=[0],
        device="cpu",
        host="127.0.0.1",
        runtime=RuntimeSpec(port=port),
    )


@contextmanager
def serving_worker(model: Path, workdir: Path, timeout: float = 120) -> Iterator[str]:
    """A `weightlift worker` process serving `model`; its base URL once Serving."""
    plan = worker_plan(model, free_port())
    plan_file = workdir / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    log_path = workdir / "worker.log"
    url = f"http://127.0.0.1:{plan.runtime.port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightlift", "worker", "--plan", str(plan_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        phase = None
        while phase not in ("Serving", "Failed"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise click.ClickException(f"worker not Serving (phase {phase}):\n{tail}")
            with suppress(httpx.HTTPError, ValueError):  # not listening yet
                phase = httpx.get(f"{url}/weightlift/v1/status", timeout=2).json().get("phase")
            time.sleep(0.05)
        if phase == "Failed":
            raise click.ClickException(f"worker Failed:\n{log_path.read_text()[-3000:]}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def render(c: OipCounts) -> str:
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(c.by_status.items()))
    lines = [f"oip: {c.requests} requests ({statuses}); failures {c.failures}"]
    for op, per in sorted(c.by_operation.items()):
        lines.append(f"  {op}: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items())))
    lines += [f"  failed {title}: {n}" for title, n in sorted(c.by_failure.items())]
    lines += [f"  worker raised {n}x: {line}" for line, n in sorted(c.worker_raised.items())]
    return "\n".join(lines)


@click.command("oip")
@click.option("--examples", "n", type=int, default=200, show_default=True, help="Per sweep.")
@click.option("--seed", type=int, default=0, show_default=True, help="-1: a new draw each run.")
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A `weightlift model make-demo` output (default: a 1 MB one, made here).",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def oip_command(n: int, seed: int, model: Path | None, json_out: Path | None) -> None:
    """The Open Inference Protocol REST spec, fuzzed against a builtin worker serving a tiny
    model. Prints the counts; exits 1 on any failure."""
    with tempfile.TemporaryDirectory(prefix="wl-oip-") as tmp:
        work = Path(tmp)
        if model is None:
            from weightlift.local.models import make_demo

            model = make_demo(work / "model", size_mb=1, tp=1, hook=False, seed=1).out
        t0 = time.monotonic()
        with serving_worker(model, work) as url:
            t1 = time.monotonic()
            counts = fuzz_oip(url, model, n, None if seed < 0 else seed)
            t2 = time.monotonic()
        for line in _RAISED.findall((work / "worker.log").read_text(errors="replace")):
            counts.worker_raised[line[:200]] = counts.worker_raised.get(line[:200], 0) + 1
    click.echo(render(counts))
    click.echo(f"  worker Serving in {t1 - t0:.1f}s; fuzz {t2 - t1:.1f}s")
    for ex in counts.examples:
        click.echo(f"  ! {ex}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(asdict(counts), indent=2) + "\n")
    if counts.failures:
        raise SystemExit(1)
