"""`weightlift bench ...`: benchmarks that print ratios measured in one run."""

from __future__ import annotations

import importlib

import click

BENCHMARKS = {
    "load": "weightlift.bench.load:load_command",
    "p2p": "weightlift.bench.p2p:p2p_command",
    "operator": "weightlift.bench.operator:operator_command",
    "vllm": "weightlift.bench.vllm:vllm_command",
    "triton": "weightlift.bench.triton:triton_command_line",
    "chaos": "weightlift.bench.chaos:chaos_command",
    "fuzz": "weightlift.bench.fuzz:fuzz_command",
    "oip": "weightlift.bench.oip:oip_command",
    "scale-out": "weightlift.bench.scaleout:scale_out_command",
    "gpu": "weightlift.bench.gpu:gpu_command",
}


class _LazyBench(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHMARKS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHMARKS:
            return None
        module_name, attr = BENCHMARKS[name].split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attr)
        return command


@click.group(cls=_LazyBench)
def bench_group() -> None:
    """Benchmarks (tables, JSON and PNG): load, p2p, operator, vllm, triton, chaos, fuzz, oip,
    scale-out, gpu."""
