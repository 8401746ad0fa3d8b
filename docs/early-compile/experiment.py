"""Issue 33 item 3, feasibility: compile and warm vLLM up on placeholder weights, then put the
real weights in place (same parameter tensors) and redo the post-load processing.

Run with the vLLM environment's python (weightlift.local.llm.vllm_python()), one mode per
process so that nothing (Dynamo caches, oneDNN handlers) leaks between them:

    python docs/early-compile/experiment.py MODEL_DIR auto   OUT.json
    python docs/early-compile/experiment.py MODEL_DIR early  OUT.json
    python docs/early-compile/experiment.py MODEL_DIR dummy  OUT.json   # control: no reload

- auto:  vLLM loads the checkpoint itself (`load_format="auto"`), as a storage-loaded replica.
         "weights available" = the moment vLLM's loader starts reading them.
- early: `load_format="dummy"` (placeholder weights of the right shapes), vLLM profiles,
         compiles and warms up; then the checkpoint is read and handed to vLLM's in-place
         `Worker.reload_weights` (layer-wise: checkpoint-format tensors, the layer's
         `process_weights_after_loading` again, values copied back into the original tensors).
- early-wl: as early, through weightlift's own in-place reload (worker/engines/vllm/inplace.py,
         what the load format does), the checkpoint fed through `model.load_weights`.
- dummy: placeholder weights only; its outputs must differ, or the comparison proves nothing.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor), in
vLLM's default CPU compile mode (Dynamo once + Inductor). Writes greedy token ids and top-5
logprobs of a few prompts, and the seconds from "weights available" to the first completion.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [
    "hello world",
    "the quick brown fox",
    "weights move from storage",
    "one two three four five six seven",
]
MAX_TOKENS = 24


def _reload_from(path: str) -> Any:
    """Runs on the worker (collective_rpc): read the checkpoint, reload in place."""

    def reload(worker: Any) -> dict[str, Any]:
        import torch
        from safetensors.torch import load_file

        model = worker.model_runner.get_model()
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        read = time.perf_counter() - started
        worker.reload_weights(weights_iterator=iter(tensors.items()))
        after = {n: p.data_ptr() for n, p in model.named_parameters()}
        return {
            "read_s": round(read, 4),
            "reload_s": round(time.perf_counter() - started - read, 4),
            "same_tensors": before == after,
            "params": len(after),
        }

    return reload


def _reload_weightlift(path: str) -> Any:
    """Runs on the worker: weightlift's own in-place reload (the load format's path), the
    checkpoint fed through vLLM's model.load_weights as a storage-loaded rank does."""

    def reload(worker: Any) -> dict[str, Any]:
        from safetensors.torch import load_file

        from weightlift.worker.engines.vllm.inplace import reload_in_place

        model = worker.model_runner.get_model()
        tensors = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        seconds = reload_in_place(
            model,
            worker.vllm_config,
            worker.model_config,
            worker.device,
            lambda params: model.load_weights(iter(tensors.items())),
        )
        return {"processing_s": round(seconds, 4)}

    return reload


def _stamp_auto_load() -> dict[str, float]:
    """Record when vLLM's default loader starts reading the weights (in this process)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    stamps: dict[str, float] = {}
    original = DefaultModelLoader.load_weights

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        stamps.setdefault("weights_available", time.perf_counter())
        original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights  # type: ignore[method-assign]
    return stamps


def main() -> None:
    model_dir, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    t_proc = time.perf_counter()
    from vllm import LLM, SamplingParams

    stamps = _stamp_auto_load() if mode == "auto" else {}
    t_import = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format="auto" if mode == "auto" else "dummy",
        dtype="float32",
        max_model_len=256,
        distributed_executor_backend="uni",
        seed=0,
    )
    t_engine = time.perf_counter()
    result: dict[str, Any] = {"mode": mode, "import_s": round(t_import - t_proc, 2)}
    result["engine_s"] = round(t_engine - t_import, 2)
    if mode in ("early", "early-wl"):
        stamps["weights_available"] = time.perf_counter()
        how = _reload_from if mode == "early" else _reload_weightlift
        result["reload"] = llm.collective_rpc(how(model_dir))[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, seed=0)
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1))
    t_first = time.perf_counter()
    if "weights_available" in stamps:
        result["weights_to_first_completion_s"] = round(t_first - stamps["weights_available"], 3)
    result["first_token"] = first[0].outputs[0].token_ids
    outputs = llm.generate(PROMPTS, params)
    result["outputs"] = [
        {
            "prompt": o.prompt,
            "token_ids": list(o.outputs[0].token_ids),
            # float.hex: exact bits, not a rounded decimal
            "logprobs": [
                {str(t): lp.logprob.hex() for t, lp in sorted(step.items())}
                for step in (o.outputs[0].logprobs or [])
            ],
        }
        for o in outputs
    ]
    result["compilation"] = str(llm.llm_engine.vllm_config.compilation_config.mode)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "outputs"}))


if __name__ == "__main__":
    main()
