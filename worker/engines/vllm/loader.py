"""`--load-format weightlift`: vLLM's model loader backed by weightlift's loaders and P2P.

Runs inside vLLM, in the process of each tensor-parallel rank (the engine core with the `uni`
executor). Per rank: read the checkpoint (peer first for a Target, with checksums verified;
storage preload otherwise or on any peer failure), hand it to vLLM's own `model.load_weights`,
require every parameter to be loaded, and (rank 0) publish the checkpoint as a weightlift P2P
source. Each rank writes a report file the weightlift worker reads; a failure writes the reason
there too, then raises so vLLM stops. What is published and why: see `weights`.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.vllm.weights import (
    CheckpointLoad,
    EngineLoadOptions,
    EngineRankReport,
    PublishedCheckpoint,
    check_model_dir,
    load_checkpoint,
    log,
    write_report,
)
from weightlift.worker.loaders.base import LoadError

# Published checkpoints live as long as the engine process (the NIXL agent must outlive reads).
_PUBLISHED: list[PublishedCheckpoint] = []


class WeightliftModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config or {}
        try:
            self.options = EngineLoadOptions.model_validate(extra)
        except ValueError as exc:
            raise ValueError(
                f"--model-loader-extra-config for load format weightlift: {exc}"
            ) from None
        self.plan = WorkerPlan.from_file(Path(self.options.plan))

    def download_model(self, model_config: ModelConfig) -> None:
        check_model_dir(model_config.model)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        rank = get_tensor_model_parallel_rank()
        started = time.perf_counter()
        try:
            check_model_dir(model_config.model)
            loaded = load_checkpoint(self.plan)
            self._feed(model, loaded)
            address = self._publish(loaded) if rank == 0 else None
        except Exception as exc:
            write_report(
                self.options.report_dir,
                EngineRankReport(rank=rank, ok=False, message=f"rank {rank}: {exc}"),
            )
            raise
        p = loaded.progress
        report = EngineRankReport(
            rank=rank,
            ok=True,
            strategy=loaded.strategy,
            loaded_from=p.loaded_from or "",
            bytes_loaded=p.bytes_loaded,
            bytes_total=p.bytes_total or p.bytes_loaded,
            seconds=p.seconds,
            gbps=p.gbps,
            peer_failures=loaded.peer_failures,
            manifest_address=address,
        )
        write_report(self.options.report_dir, report)
        log.info(
            "weightlift: rank %d loaded %d bytes from %s (%s) in %.3fs; feed+publish %.3fs",
            rank,
            p.bytes_loaded,
            report.loaded_from,
            loaded.strategy,
            p.seconds,
            time.perf_counter() - started,
        )

    @staticmethod
    def _feed(model: nn.Module, loaded: CheckpointLoad) -> None:
        """vLLM's own weight loading (stacking, TP slicing, casts), then a strict name check."""
        names = model.load_weights(iter(loaded.tensors.items()))  # type: ignore[operator]
        if names is None:
            return
        missing = sorted({n for n, _ in model.named_parameters()} - set(names))
        if missing:
            raise LoadError(
                f"checkpoint lacks {len(missing)} parameter(s) the model needs, e.g. {missing[0]!r}"
            )

    def _publish(self, loaded: CheckpointLoad) -> str | None:
        try:
            published = PublishedCheckpoint(self.plan, loaded.tensors)
        except Exception as exc:  # NIXL missing or failing: still serve, just not as a source
            log.warning("weightlift: cannot publish as a P2P source: %s", exc)
            return None
        _PUBLISHED.append(published)
        return published.address
