"""Entry point `vllm.general_plugins: weightlift`: registers `--load-format weightlift`.

vLLM calls `register()` in every one of its processes, possibly more than once: idempotent.
"""

from __future__ import annotations

import ctypes
import os
import signal

from weightlift.worker.engines.vllm.aot_load import allow_bundled_aot_reload
from weightlift.worker.engines.vllm.ranks import LOAD_FORMAT
from weightlift.worker.engines.vllm.store_bind import bind_store_to_pod_ip

# Set by the worker in the environment of the vLLM it starts (engine.vllm_environment).
DIE_WITH_PARENT_ENV = "WEIGHTLIFT_VLLM_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1

_registered = False


def die_with_parent_if_asked() -> None:
    """Each vLLM process started for a worker (API server, engine core, rank workers) dies with its
    parent. The worker can only arm its direct child; vLLM's engine core outlived a SIGKILLed
    worker by over an hour in a test run, holding 2 GB. Only under the worker: a user's own
    `vllm serve` in an environment where weightlift is installed is left alone."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def register() -> None:
    global _registered
    if _registered:
        return
    die_with_parent_if_asked()
    allow_bundled_aot_reload()  # a second start loads vLLM's compiled artifact (see aot_load)
    bind_store_to_pod_ip()  # a group leader's store: its pod IP only (see store_bind)
    from vllm.model_executor.model_loader import register_model_loader

    from weightlift.worker.engines.vllm.loader import WeightliftModelLoader

    register_model_loader(LOAD_FORMAT)(WeightliftModelLoader)
    _registered = True
