"""`--load-format weightlift`: vLLM's model loader backed by weightlift's loaders and P2P.

Runs inside vLLM, in the process of each tensor-parallel rank (the engine core with the `uni`
executor, one worker process per rank with `mp`). Per rank: run the model's init hooks
(fail-closed; released when the process exits), fill the rank's parameters (a Target pulls
exactly them from the same rank of a peer, checksums verified; a Source, or a Target on any
peer failure, reads the checkpoint with storage preload and hands it to vLLM's own
`model.load_weights`, every parameter required), publish them as this rank's weightlift P2P
source, then let vLLM process them. Each rank writes a report file the weightlift worker reads:
once when vLLM reaches the weight load, once at the end with where each step's seconds went; a
failure writes the reason there too, then raises so vLLM stops. What is published and why: see
`weights`.

Standby with `compileFirst` (an unquantized model): the rank fills its parameters with
placeholders and returns the model at once, so vLLM profiles, compiles and warms up while the
pod waits; a thread then waits for the relayed hand-off (the worker relays it once vLLM answers
/health: vLLM is idle then, and no request reaches it before the worker is Ready) and puts the
weights into the same tensors, redoing vLLM's post-load processing (`inplace`).
"""

from __future__ import annotations

import atexit
import threading
import time
from pathlib import Path

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

from weightlift.api.worker import WorkerPlan
from weightlift.worker.engines.vllm.inplace import reload_in_place
from weightlift.worker.engines.vllm.ranks import (
    RELAY_MARGIN_SECONDS,
    EngineLoadOptions,
    EngineRankReport,
    check_model_dir,
    holds_weights,
    write_report,
)
from weightlift.worker.engines.vllm.weights import (
    PublishedRank,
    RankLoad,
    load_rank,
    log,
    run_rank_hooks,
)
from weightlift.worker.hooks import InitHookSession
from weightlift.worker.loaders.strategy import wants_peer_to_peer
from weightlift.worker.standby import apply_handoff, wait_for_handoff_blocking, wait_limit
from weightlift.worker.weights.progress import LoadError

# Published ranks live as long as the engine process (the NIXL agent must outlive reads).
_PUBLISHED: list[PublishedRank] = []
# Our parameters are this vLLM's, before its post-load processing: a peer's must be the same
# version's (RankManifest.layout), not only the same names and shapes.
LAYOUT = f"vLLM {vllm.__version__}"
# Init hook handles live as long as the engine process; released (then dlclosed) at its exit.
_HOOKS: list[InitHookSession] = []


def _release_hooks() -> None:
    while _HOOKS:
        for problem in _HOOKS.pop().release():
            log.warning("weightlift: init hook release: %s", problem)


atexit.register(_release_hooks)


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
        self.report = EngineRankReport(rank=0, ok=True)
        # The publishing thread updates the report too; every change and write holds this.
        self._report_lock = threading.Lock()

    def download_model(self, model_config: ModelConfig) -> None:
        check_model_dir(model_config.model, weights=self._holds_weights())

    def _holds_weights(self) -> bool:
        # A remote model in standby: only the small files came; storage downloads the rest.
        return holds_weights(self.plan) and not self.options.handoff

    def _stamp(self, step: str) -> None:
        self.report.timeline[step] = round(time.time(), 3)

    def _write_report(self) -> None:
        with self._report_lock:
            write_report(self.options.report_dir, self.report)

    def _compiles_first(self, model_config: ModelConfig) -> bool:
        return bool(self.options.handoff and self.options.compile_first) and (
            model_config.quantization is None
        )

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        """vLLM's own flow (create, load_weights, process) between our reports and hooks."""
        rank = get_tensor_model_parallel_rank()
        self.report = EngineRankReport(rank=rank, ok=True, stage="loading")
        self.report.compiles_first = self._compiles_first(model_config)
        self._stamp("engine")
        try:
            self._write_report()
            if wants_peer_to_peer(self.plan) or self.options.handoff:
                # NIXL's first agent loads NIXL and UCX (0.07-0.5 s): pay it while the hooks
                # run and vLLM builds the model, not inside the pull.
                from weightlift.worker.p2p.target import prewarm_nixl

                prewarm_nixl(agents=1)
            session = run_rank_hooks(self.plan, rank)
            if session is not None:
                _HOOKS.append(session)
                self.report.hooks = list(session.reports)
            self._stamp("hooks")
            self._write_report()  # the weights' turn now
            model = super().load_model(vllm_config, model_config, prefix)
        except Exception as exc:
            self._fail(exc)
            raise
        if self.report.compiles_first:
            with self._report_lock:
                self.report.stage = "standby"
                self._stamp("standby")
                write_report(self.options.report_dir, self.report)
            threading.Thread(
                target=self._load_later,
                args=(model, vllm_config, model_config),
                name="wl-weights",
                daemon=True,
            ).start()
            return model
        with self._report_lock:
            self._stamp("processed")
            self.report.stage = "done"
            write_report(self.options.report_dir, self.report)
        log.info("weightlift: rank %d steps %s", rank, self.report.timeline)
        return model

    def _fail(self, exc: Exception) -> None:
        with self._report_lock:
            self.report.ok = False
            self.report.message = f"rank {self.report.rank}: {exc}"
            self.report.permanent = bool(getattr(exc, "permanent", False))
            write_report(self.options.report_dir, self.report)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if self.report.compiles_first:
            # Placeholders of the right shapes (parameters only: buffers keep their init
            # values, which the in-place load keeps too); vLLM processes them as real ones.
            for param in model.parameters():
                initialize_single_dummy_weight(param)
            return
        self._standby()
        self._load_into(model, model_config, dict(model.named_parameters()))

    def _load_later(
        self, model: nn.Module, vllm_config: VllmConfig, model_config: ModelConfig
    ) -> None:
        """Compile-first standby's thread: the hand-off, then the weights in place."""
        try:
            self._standby()
            device = torch.device(
                self.load_config.device or vllm_config.device_config.device or "cpu"
            )
            seconds = reload_in_place(
                model,
                vllm_config,
                model_config,
                device,
                lambda params: self._load_into(model, model_config, params),
            )
        except Exception as exc:
            log.exception("weightlift: rank %d: weights after compile failed", self.report.rank)
            self._fail(exc)
            return
        with self._report_lock:
            self._stamp("processed")
            self.report.stage = "done"
            write_report(self.options.report_dir, self.report)
        log.info(
            "weightlift: rank %d weights in place after compile (processing %.3fs); steps %s",
            self.report.rank,
            seconds,
            self.report.timeline,
        )

    def _load_into(
        self, model: nn.Module, model_config: ModelConfig, params: dict[str, torch.Tensor]
    ) -> None:
        """Fill `params` (the rank's parameters before vLLM's processing), then publish."""
        rank = self.report.rank
        started = time.perf_counter()
        check_model_dir(model_config.model, weights=self._holds_weights())
        loaded = load_rank(
            self.plan, rank, params, lambda ckpt: self._feed(model, ckpt), layout=LAYOUT
        )
        p = loaded.progress
        with self._report_lock:
            self._stamp("load")
            self.report = self.report.model_copy(
                update={
                    "strategy": loaded.strategy,
                    "loaded_from": p.loaded_from or "",
                    "bytes_loaded": p.bytes_loaded,
                    "bytes_total": p.bytes_total or p.bytes_loaded,
                    "seconds": p.seconds,
                    "gbps": p.gbps,
                    "peer_failures": loaded.peer_failures,
                    "transport": p.transport,
                    "transport_note": p.transport_note,
                    "load_phases": dict(p.phases),
                    "publishing": True,
                }
            )
        # Checksums, the NIXL agent and its registration take ~0.8 s for 155 MB on 2 cores:
        # off vLLM's path to Ready (its post-load processing and compile go on meanwhile). The
        # snapshot they publish was taken inside load_rank, before any post-load processing.
        threading.Thread(
            target=self._publish, args=(rank, loaded), name="wl-publish", daemon=True
        ).start()
        log.info(
            "weightlift: rank %d loaded %d bytes from %s (%s%s) in %.3fs (%.3fs in all)",
            rank,
            p.bytes_loaded,
            self.report.loaded_from,
            loaded.strategy,
            f", over {p.transport}" if p.transport else "",
            p.seconds,
            time.perf_counter() - started,
        )

    def _standby(self) -> None:
        """Standby: the model is built on its device, hooks run; report stage "standby" and
        wait (bounded as the worker's own wait, plus its compile-cache fetch) until the worker
        relays the hand-off, then load with the handed peers, or from storage."""
        if not self.options.handoff:
            return
        self.report.stage = "standby"
        self._stamp("standby")
        self._write_report()
        limit = wait_limit(self.plan) + RELAY_MARGIN_SECONDS
        handoff = wait_for_handoff_blocking(Path(self.options.handoff), limit)
        self.plan = apply_handoff(self.plan, handoff)
        self.report.stage = "loading"
        self._stamp("peers")
        self._write_report()
        log.info("weightlift: rank %d standby over: %s", self.report.rank, handoff.to_text())

    @staticmethod
    def _feed(model: nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
        """vLLM's own weight loading (stacking, TP slicing, casts), then a strict name check."""
        names = model.load_weights(iter(checkpoint.items()))  # type: ignore[operator]
        if names is None:
            return
        missing = sorted({n for n, _ in model.named_parameters()} - set(names))
        if missing:
            raise LoadError(
                f"checkpoint lacks {len(missing)} parameter(s) the model needs, e.g. {missing[0]!r}"
            )

    def _publish(self, rank: int, loaded: RankLoad) -> None:
        started = time.perf_counter()
        address = None
        try:
            published = PublishedRank(self.plan, rank, loaded.published, layout=LAYOUT)
        except Exception as exc:  # NIXL missing or failing: still serve, just not as a source
            log.warning("weightlift: rank %d cannot publish as a P2P source: %s", rank, exc)
        else:
            _PUBLISHED.append(published)
            address = published.address
            log.info(
                "weightlift: rank %d published at %s in %.3fs",
                rank,
                address,
                time.perf_counter() - started,
            )
        with self._report_lock:
            self.report.manifest_address = address
            self.report.publishing = False
            write_report(self.options.report_dir, self.report)
