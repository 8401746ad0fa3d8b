"""Put a rank's real weights into a model that vLLM already compiled and warmed up on
placeholders, in the same tensors, and redo vLLM's post-load processing.

Why this works (measured, docs/early-compile/README.md): vLLM's compiled program reads every
parameter, and on CPU each linear layer's `cpu_linear` (the oneDNN / sgl-kernel handle
`process_weights_after_loading` packs), from the module when it runs: none is baked into the
graph. So the weights can change after the compile, provided they land in the tensors the
program already holds and the packing is redone. The outputs are then bit-identical to a
replica that loaded the same weights before compiling (greedy token ids and logprobs).

The steps follow vLLM's layer-wise reload (`model_loader/reload`, the RLHF path), for the
parameters only (buffers such as rotary tables and attention scales do not depend on the
weights of an unquantized model and stay as they are):
1. each layer's processed ("kernel") parameters are set aside and the layer gets back the
   parameters it had before any processing (vLLM recorded their metadata when it built the
   model), empty, on the rank's device;
2. `fill` loads them (the load format's P2P pull or checkpoint feed, which expects exactly
   these pre-processing parameters and snapshots them for publishing);
3. vLLM's `process_weights_after_loading` runs over the whole model (repacking included);
4. the processed values are copied into the set-aside tensors, which go back on the layers.
Every layer is materialized at once (step 2 needs them all): peak memory is the processed
model plus one pre-processing copy. Quantized models are not handled (their processing
rewrites scales and buffers): `compiles_before_weights` keeps them on the blocking path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
from vllm.model_executor.model_loader.utils import process_weights_after_loading

Tensors = dict[str, torch.Tensor]


def reload_in_place(
    model: nn.Module,
    vllm_config: VllmConfig,
    model_config: ModelConfig,
    device: torch.device,
    fill: Callable[[Tensors], None],
) -> float:
    """Steps 1-4 above; `fill` gets the pre-processing parameters by name. Returns the seconds
    spent outside `fill` (vLLM's processing and the copies back)."""
    started = time.perf_counter()
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    layers = list(model.modules())
    kept: list[tuple[nn.Module, Tensors, Tensors]] = []
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for layer in layers:
            params: Tensors = {n: p for n, p in layer._parameters.items() if p is not None}
            buffers = {n: b for n, b in layer._buffers.items() if b is not None}
            persistent = {n for n in buffers if n not in layer._non_persistent_buffers_set}
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for name, buf in buffers.items():  # the buffers stay the kernel ones
                if name in layer._buffers or hasattr(layer, name):
                    delattr(layer, name)
                layer.register_buffer(name, buf, persistent=name in persistent)
            materialize_layer(layer, get_layerwise_info(layer))
            kept.append((layer, params, buffers))
        fill_started = time.perf_counter()
        fill(dict(model.named_parameters()))
        filled = time.perf_counter() - fill_started
        process_weights_after_loading(model, model_config, device)
        for layer, kernel_params, kernel_buffers in kept:
            _put_back(layer, kernel_params, kernel_buffers)
    after = {name: p.data_ptr() for name, p in model.named_parameters()}
    if after != before:
        # The compiled program holds the old tensors: serving now would be wrong, not slow.
        moved = sorted(set(before.items()) ^ set(after.items()))
        raise RuntimeError(f"in-place reload changed {len(moved)} parameter(s): {moved[:2]}")
    return time.perf_counter() - started - filled


def _put_back(layer: nn.Module, params: Tensors, buffers: Tensors) -> None:
    """Step 4 for one layer: processed values into its kernel tensors, kernel tensors back on
    the layer (whatever processing registered instead is dropped, as vLLM's reload does)."""
    for name, kernel in params.items():
        kernel.data.copy_(getattr(layer, name))
    for name, kernel in buffers.items():
        now = layer._buffers.get(name)
        if now is not None and now is not kernel:
            kernel.data.copy_(now)
    persistent = {n for n in buffers if n not in layer._non_persistent_buffers_set}
    for name in [*layer._parameters, *layer._buffers]:
        delattr(layer, name)
    for name, kernel in params.items():
        layer.register_parameter(name, kernel)  # type: ignore[arg-type]
    for name, kernel in buffers.items():
        layer.register_buffer(name, kernel, persistent=name in persistent)
