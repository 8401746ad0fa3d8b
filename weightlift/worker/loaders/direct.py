"""Direct: per-tensor `safe_open(...).get_tensor` onto the device; the baseline and fallback."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from weightlift.worker.weights.files import ShardIndex, shard_index
from weightlift.worker.weights.progress import LoadError, LoadProgress
from weightlift.worker.weights.tensors import file_residues, place

if TYPE_CHECKING:
    from weightlift.api.worker import WorkerPlan


class DirectLoader:
    name = "direct"

    def load(
        self, plan: WorkerPlan, rank: int, device: torch.device, progress: LoadProgress
    ) -> dict[str, torch.Tensor]:
        return self.load_index(
            shard_index(plan.model_dir, rank, plan.tensor_parallel), device, progress
        )

    def load_index(
        self, index: ShardIndex, device: torch.device, progress: LoadProgress
    ) -> dict[str, torch.Tensor]:
        # Headers were validated by shard_index, so safetensors sees only well-formed files.
        progress.set_total(index.data_bytes)
        dev = str(torch.device(device))
        out: dict[str, torch.Tensor] = {}
        for h in index.files:
            try:
                with safe_open(h.path, framework="pt", device=dev) as f:
                    for name, info in h.tensors.items():
                        out[name] = f.get_tensor(name)
                        progress.add(info.nbytes)
            except LoadError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise LoadError(f"{h.path}: {exc}") from exc
        # safetensors maps CPU tensors at the file's offsets (their canonical residue: nothing
        # copied) and allocates CUDA ones fresh; `place` fixes any other placement.
        infos = (info for _, info in index.tensors.values())
        out, _ = place(out, file_residues(infos, torch.device(device)))
        progress.finish()
        return out
