"""Engines: what serves the model in a worker pod, behind one interface (base.py), chosen from
one registry by `runtime.engine`. Each engine module is imported only when chosen: vLLM's
needs its own environment, the builtin one needs torch.export."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from weightlift.api.model import Engine as EngineName

if TYPE_CHECKING:
    from weightlift.api.worker import WorkerPlan
    from weightlift.worker.engines.base import Engine

# runtime.engine -> "module:factory"; the factory takes the WorkerPlan.
REGISTRY: dict[EngineName, str] = {
    EngineName.BUILTIN: "weightlift.worker.engines.builtin.engine:BuiltinEngine",
    EngineName.VLLM: "weightlift.worker.engines.vllm.engine:VllmEngine.for_worker",
    EngineName.TRITON: "weightlift.worker.engines.triton.engine:TritonEngine.for_worker",
}


def create_engine(plan: WorkerPlan) -> Engine:
    """The engine `plan.runtime.engine` names."""
    target = REGISTRY.get(plan.runtime.engine)
    if target is None:
        raise ValueError(f"runtime.engine {plan.runtime.engine} has no engine in this worker")
    module_name, _, attr = target.partition(":")
    factory: object = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    engine: Engine = factory(plan)  # type: ignore[operator]
    return engine
