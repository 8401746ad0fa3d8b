"""`weightlift bench vllm --scale-up`: the scale-ups autoscaling users live, for vLLM, on the
local stack with the operator (process node), each timed from the scale-subresource patch (what
`kubectl scale` and an HPA do) to the new replica's Ready in the status (local/scaleup.py):

  scale-up 1→2, spare   a warm spare (spec.warmSpares: 1, its vLLM started up to the weight
                        step) is handed its peer and the peer's compile cache
  scale-up 1→2, cold    no spare: the operator creates a pod that starts from nothing (it
                        still pulls the weights and the compile cache from its peer)
  scale-up 0→1, spare   scaled to zero with one spare kept: the spare is handed storage

`vllm_command` divides each by `auto`'s cold start of the same run (vLLM alone, its own loader,
compiling from scratch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightlift.local.observe import Observer
from weightlift.local.scaleup import ScaleUp, scale_up, serving_ready, set_warm_spares, wait_spares
from weightlift.local.stack import (
    VLLM_ENV,
    LocalStack,
    add_hook_library,
    model_deployment,
    vllm_engine_args,
)

JSON = dict[str, Any]
NAME = "scaleup"
ROWS = ("scale-up 1→2, spare", "scale-up 1→2, cold", "scale-up 0→1, spare")


def _scale_to(obs: Observer, replicas: int, spares: int, timeout: float) -> None:
    """Scale down (or keep) to `replicas` serving and `spares` warm spares, and wait for it."""
    obs.stack.scale_md(obs.name, replicas)

    def settled(o: Observer) -> bool:
        status = o.status()
        return (
            status.get("replicas") == replicas
            and len(serving_ready(o)) == replicas
            and len(o.pods) == replicas + spares
        )

    obs.wait(settled, timeout, f"{obs.name}: {replicas} replica(s) and {spares} spare(s)")
    if spares:
        wait_spares(obs, spares, timeout)


def scale_up_rows(
    python: Path, model: Path, probe: JSON, work: Path, timeout: float, enforce_eager: bool
) -> dict[str, JSON]:
    """The three rows, on one deployment of `model` (a tiny Llama in HF layout)."""
    add_hook_library(model)
    stack = LocalStack(work / "stack", model_path_prefixes=(str(model),))
    stack.worker_env["WEIGHTLIFT_VLLM_PYTHON"] = str(python)
    ups: list[ScaleUp] = []
    with stack:
        manifest = model_deployment(
            NAME,
            model,
            replicas=1,
            probe=probe,
            engine="vLLM",
            engine_args=vllm_engine_args(enforce_eager),
            env=VLLM_ENV,
            warm_spares=1,
        )
        obs = Observer(stack, NAME)
        stack.apply(manifest)
        obs.wait_ready(timeout)
        wait_spares(obs, 1, timeout)
        ups.append(scale_up(obs, 2, "spare", timeout))
        set_warm_spares(obs, 0, timeout)
        _scale_to(obs, 1, 0, timeout)
        ups.append(scale_up(obs, 2, "cold", timeout))
        stack.patch_md(NAME, {"spec": {"warmSpares": 1}})
        _scale_to(obs, 0, 1, timeout)
        ups.append(scale_up(obs, 1, "spare", timeout))
    return {name: up.as_json() for name, up in zip(ROWS, ups, strict=True)}
