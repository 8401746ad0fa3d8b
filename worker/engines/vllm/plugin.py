"""Entry point `vllm.general_plugins: weightlift`: registers `--load-format weightlift`.

vLLM calls `register()` in every one of its processes, possibly more than once: idempotent.
"""

from __future__ import annotations

from weightlift.worker.engines.vllm.weights import LOAD_FORMAT

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from weightlift.worker.engines.vllm.loader import WeightliftModelLoader

    register_model_loader(LOAD_FORMAT)(WeightliftModelLoader)
    _registered = True
