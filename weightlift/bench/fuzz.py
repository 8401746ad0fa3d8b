"""`weightlift bench fuzz`: hypothesis-generated hostile input, counted.

specs: ModelDeployments from the CRD schema (bench/fuzz_specs.py) created on the real API
server with the real operator running. headers: malformed safetensors files through the parser
and every storage loader (bench/fuzz_headers.py). Crashes must be 0.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from hypothesis import HealthCheck, Phase, given, settings

from weightlift.api.model import GROUP, PLURAL, VERSION
from weightlift.bench.fuzz_headers import Case, HeaderCounts, cases, check_case
from weightlift.bench.fuzz_specs import (
    Mutation,
    SpecCounts,
    mutable_fields,
    names_a_field,
    operator_failures,
    spec_schema,
    specs,
)

JSON = dict[str, Any]
BATCH = 25  # admitted specs live this long (in creations) before they are deleted


def _settings(n: int, seed: int | None) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        phases=[Phase.generate],  # counting, not shrinking: every case is one apply
        suppress_health_check=list(HealthCheck),
    )


def fuzz_headers(n: int, seed: int | None = 0, work: Path | None = None) -> HeaderCounts:
    counts = HeaderCounts()
    with tempfile.TemporaryDirectory(prefix="wl-fuzz-headers-", dir=work) as tmp:
        root = Path(tmp)

        @_settings(n, seed)
        @given(case=cases())
        def one(case: Case) -> None:
            check_case(case, root / f"c{counts.cases}", counts)

        one()
    return counts


def fuzz_specs(
    stack: Any, n: int, seed: int | None = 0, model_prefix: str = "/models"
) -> SpecCounts:
    """`stack`: a LocalStack (kube, namespace, operator log). Admitted specs are deleted again in
    batches, after the operator had them for a while."""
    from kubernetes.client.exceptions import ApiException

    from weightlift.local.kube import call

    counts = SpecCounts()
    fields = mutable_fields(spec_schema())
    log_path = Path(stack.state_dir) / "operator.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    admitted: list[str] = []

    def drain() -> None:
        time.sleep(1.0)
        for name in admitted:
            try:
                stack.delete_md(name)
            except ApiException as exc:
                if exc.status >= 500:
                    counts.api_5xx += 1
        admitted.clear()

    @_settings(n, seed)
    @given(drawn=specs(fields, model_prefix))
    def one(drawn: tuple[JSON, list[Mutation]]) -> None:
        spec, muts = drawn
        name = f"fz-{counts.cases}"
        counts.cases += 1
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": stack.namespace},
            "spec": spec,
        }
        create = stack.kube.custom.create_namespaced_custom_object
        try:
            call(create, GROUP, VERSION, stack.namespace, PLURAL, body, field_validation="Strict")
        except ApiException as exc:
            text = str(exc.body or "")
            if exc.status == 422 or exc.status == 400:
                if names_a_field(text, muts):
                    counts.rejected_field_named += 1
                else:
                    counts.rejected_vague += 1
                    if len(counts.vague_examples) < 10:
                        counts.vague_examples.append(text[:300])
            elif exc.status >= 500:
                counts.api_5xx += 1
            else:
                counts.other_status += 1
            return
        counts.admitted += 1
        admitted.append(name)
        if len(admitted) >= BATCH:
            drain()

    one()
    drain()
    time.sleep(3.0)  # the operator's last reactions land in its log
    counts.operator_died = stack._operator is None or stack._operator.poll() is not None
    text = log_path.read_bytes()[log_start:].decode(errors="replace")
    failures = operator_failures(text)
    counts.operator_exceptions = len(failures)
    counts.vague_examples += failures[:5]
    return counts


def render_specs(c: SpecCounts) -> str:
    return (
        f"specs: {c.cases} cases, {c.admitted} admitted, {c.rejected_field_named} rejected "
        f"naming the field, {c.rejected_vague} rejected without naming it, {c.other_status} "
        f"other statuses; crashes {c.crashes} (API 5xx {c.api_5xx}, operator exceptions "
        f"{c.operator_exceptions}, operator died {c.operator_died})"
    )


def render_headers(c: HeaderCounts) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(c.by_fault.items()))
    return (
        f"headers: {c.cases} cases, {c.rejected_named} rejected with our error naming the file "
        f"(parser, preload mapped, preload staged, direct), {c.loaded_valid} still-valid files "
        f"loaded bit-equal to safetensors' load_file; crashes {c.crashes} (other exceptions "
        f"{c.other_exception}, unnamed errors {c.unnamed_error}, hangs {c.hangs}, tensors from "
        f"a bad file {c.tensors_from_bad_file})\n  faults drawn: {faults}"
    )


@click.command("fuzz")
@click.option("--specs", "n_specs", type=int, default=1000, show_default=True)
@click.option("--headers", "n_headers", type=int, default=1000, show_default=True)
@click.option("--seed", type=int, default=None, help="Derandomize (a fixed sequence).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".state/fuzz"),
    show_default=True,
)
def fuzz_command(
    n_specs: int, n_headers: int, seed: int | None, json_out: Path | None, state_dir: Path
) -> None:
    """Generated ModelDeployments against the API server + operator; malformed safetensors
    headers against every loader. Prints the counts; exits 1 on any crash."""
    from weightlift.local.stack import LocalStack

    report: JSON = {}
    failed = False
    if n_headers:
        hc = fuzz_headers(n_headers, seed)
        click.echo(render_headers(hc))
        for ex in hc.examples:
            click.echo(f"  ! {ex}")
        report["headers"] = asdict(hc)
        failed |= hc.crashes > 0
    if n_specs:
        state_dir = state_dir.resolve()
        with LocalStack(state_dir / "stack", node_name="fuzz-node") as stack:
            sc = fuzz_specs(stack, n_specs, seed, model_prefix=str(state_dir / "models"))
        click.echo(render_specs(sc))
        for ex in sc.vague_examples:
            click.echo(f"  ! {ex}")
        report["specs"] = asdict(sc)
        failed |= sc.crashes > 0
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        raise SystemExit(1)
