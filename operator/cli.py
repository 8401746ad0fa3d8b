"""`weightlift` command line. Subcommands live in their own modules and load lazily, so
`weightlift operator` never imports torch and `weightlift --help` is instant."""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command or group.
SUBCOMMANDS: dict[str, str] = {
    "crd": "weightlift.operator.crd:crd_command",
    "operator": "weightlift.operator.run:operator_command",
    "cluster": "weightlift.operator.cluster:cluster_group",
    "node": "weightlift.operator.processnode:node_command",
    "demo": "weightlift.operator.demo:demo_command",
    "worker": "weightlift.worker.main:worker_command",
    "model": "weightlift.worker.demo_model:model_group",
    "bench": "weightlift.worker.bench:bench_group",
}

HELP = {
    "crd": "Print the ModelDeployment CRD generated from the pydantic model.",
    "operator": "Run the operator (kopf) against the current kubeconfig.",
    "cluster": "Start/stop a local control plane (etcd, kube-apiserver, scheduler, kwok).",
    "node": "Run the local process node (runs worker pods as processes).",
    "demo": "Run the whole lifecycle locally: control plane, operator, workers, READY.",
    "worker": "Run the model worker (init hooks, load, serve KServe v2).",
    "model": "Make demo models.",
    "bench": "Benchmarks: load, p2p.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name

            @click.command(name=name, help=f"(unavailable: {missing} is not installed)")
            def unavailable() -> None:
                raise click.ClickException(
                    f"'weightlift {name}' needs the module {missing!r}; "
                    "install weightlift with the extra that provides it (e.g. '.[worker]')"
                )

            return unavailable
        command: click.Command = getattr(module, attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help without importing every subcommand module.
        rows = [(name, HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="weightlift")
def main() -> None:
    """weightlift: fast, honest model loading on GPU clusters."""


if __name__ == "__main__":
    main()
