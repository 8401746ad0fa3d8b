"""`weightlift` command line: the root group. Each room registers its commands under the entry
point group `weightlift.commands` (pyproject.toml); they load lazily, so `weightlift operator`
never imports torch and `weightlift --help` is instant."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import click

GROUP = "weightlift.commands"

# One line each for `--help`, without importing the command modules.
HELP = {
    "crd": "Print the ModelDeployment CRD generated from the pydantic model.",
    "operator": "Run the operator (kopf) against the current kubeconfig.",
    "cluster": "Start/stop a local control plane (etcd, kube-apiserver, scheduler, kwok).",
    "node": "Run the local process node (runs worker pods as processes).",
    "demo": "Run the whole lifecycle locally: control plane, operator, workers, READY.",
    "worker": "Run the model worker (init hooks, load, serve KServe v2).",
    "model": "Make demo models.",
    "bench": "Benchmarks: load, p2p, operator.",
}


def _commands() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_commands())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        entry = _commands().get(name)
        if entry is None:
            return None
        try:
            command = entry.load()
        except ModuleNotFoundError as exc:
            missing = exc.name or entry.module

            @click.command(name=name, help=f"(unavailable: {missing} is not installed)")
            def unavailable() -> None:
                raise click.ClickException(
                    f"'weightlift {name}' needs the module {missing!r}, which this installation "
                    "lacks; install weightlift with the extra that provides it (e.g. '.[worker]')"
                )

            return unavailable
        if not isinstance(command, click.Command):
            raise click.ClickException(f"entry point {entry.value} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="weightlift")
def main() -> None:
    """weightlift: fast, honest model loading on GPU clusters."""


@click.command("crd")
def crd_command() -> None:
    """Print the ModelDeployment CRD generated from the pydantic model (api/crd.py)."""
    from weightlift.api.crd import render_crd

    click.echo(render_crd(), nl=False)
