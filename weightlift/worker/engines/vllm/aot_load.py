"""Make vLLM 0.32's AOT compile artifact reload on CPU; the plugin applies it in each vLLM process.

On CPU vLLM compiles in `DYNAMO_TRACE_ONCE` mode with torch's own `inductor` backend, so torch's
`aot_compile_fullgraph` wraps the compiled program in `BundledAOTAutogradSerializableCallable`
(not vLLM's `VllmSerializableFunction`). On the next start vLLM's `_try_load_aot_compiled_fn`
calls `compiled_fn.finalize_loading(vllm_config)` on whatever it loaded; the torch wrapper has no
such method and forwards the lookup to the plain function it wraps, so the load fails with
"'function' object has no attribute 'finalize_loading'" and vLLM compiles again, every start.
The bundled artifact is complete once deserialized (`deserialize_bundled_cache_entry` returns a
callable program), so finalizing it is a no-op: this gives the torch wrapper that no-op. Nothing
is changed where torch already has the method or lacks the wrapper.

Only the standard library at import time: the plugin imports this in every vLLM process.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm.weightlift.aot_load")


def _finalize_loading(self: Any, vllm_config: Any) -> None:
    """A bundled Inductor artifact is loaded in full by its deserializer: nothing left to do."""


def allow_bundled_aot_reload() -> bool:
    """Give torch's bundled AOT callable the `finalize_loading` vLLM calls on reload; True when
    this process now has it (patched here or already there), False when torch lacks the class."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:
        return False
    # The class's own attribute, not the instance's __getattr__ forwarding to the wrapped function.
    if "finalize_loading" not in vars(BundledAOTAutogradSerializableCallable):
        BundledAOTAutogradSerializableCallable.finalize_loading = _finalize_loading  # type: ignore[attr-defined]
        log.debug("weightlift: bundled AOT artifacts reload without finalize_loading")
    return True
