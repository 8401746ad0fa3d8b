"""The engine-side weight path of the vLLM load format, free of vLLM imports (unit-testable).

What is moved and published: the **checkpoint tensors as the files hold them** (names, dtypes,
shapes of model.safetensors), not vLLM's parameters after loading. vLLM's post-load processing
is not portable: on CPU `process_weights_after_loading` repacks every linear weight into an
opaque oneDNN / sgl-kernel handle and leaves `layer.weight` empty; on GPU quantized kernels
permute and repack. So a target pulls the checkpoint tensors (checksums verified, the same
manifest as every weightlift source) and runs vLLM's own `model.load_weights` (fused qkv /
gate_up stacking, tensor-parallel slicing, dtype cast) and post-processing, exactly as if it
had read the files. TRT-LLM's presharded path publishes before processing for the same reason;
ModelExpress publishes after, which only works where processing leaves plain tensors.

Cost of that choice: the source keeps the checkpoint in host memory (the preload mapping: page
cache, shared with other pods on the node), and with tensor parallelism every rank needs the
whole checkpoint; rank 0 publishes it and every target rank pulls from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import Field

from weightlift.api.model import ApiModel
from weightlift.api.storage import ModelUri
from weightlift.api.worker import HookReport, WorkerPlan
from weightlift.worker.hooks import InitHookSession, run_init_hooks
from weightlift.worker.loaders.base import LoadError, LoadProgress
from weightlift.worker.loaders.select import choose_storage_loader, wants_peer_to_peer

log = logging.getLogger("vllm.weightlift")  # vLLM's handler only prints `vllm.*` loggers

LOAD_FORMAT = "weightlift"
CPU = torch.device("cpu")


class ModelDirError(LoadError):
    """The model directory cannot be served by vLLM (permanent: the files are wrong)."""

    permanent = True


class EngineLoadOptions(ApiModel):
    """`--model-loader-extra-config` of the weightlift load format (camelCase JSON)."""

    plan: str = Field(description="Path of the WorkerPlan JSON file.")
    report_dir: str = Field(description="Where each rank writes rank-<r>.json.")


class EngineRankReport(ApiModel):
    """What one vLLM rank says about its load; the worker folds it into its WorkerReport.

    Written twice: when vLLM reaches the weight load (stage "loading", so the worker can show
    where vLLM is) and when the weights are loaded and processed (stage "done"), or on failure.
    """

    rank: int
    ok: bool
    stage: str = "done"  # loading | done
    message: str = ""
    permanent: bool = False  # retrying cannot help (bad files, a missing hook symbol)
    strategy: str = ""
    loaded_from: str = ""
    bytes_loaded: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    peer_failures: list[str] = Field(default_factory=list)
    # 127.0.0.1:port of the P2P manifest server (rank 0 only); the worker proxies to it.
    manifest_address: str | None = None
    hooks: list[HookReport] = Field(default_factory=list)
    # Wall clock (Unix seconds) at which each step of this rank ended: engine (vLLM started and
    # initialized up to its weight load), hooks, load (checkpoint in memory), processed (vLLM's
    # load_weights and post-load processing done).
    timeline: dict[str, float] = Field(default_factory=dict)
    load_phases: dict[str, float] = Field(default_factory=dict)
    finished_at: float = Field(default_factory=time.time)


def check_model_dir(model_dir: str | Path) -> Path:
    """An HF model directory vLLM can serve: config.json, tokenizer, *.safetensors."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"model dir {d} does not exist or is not a directory")
    if not (d / "config.json").is_file():
        raise ModelDirError(f"model dir {d}: config.json not found (an HF model directory)")
    if not any(d.glob("*.safetensors")):
        raise ModelDirError(f"model dir {d}: no *.safetensors files")
    if not any((d / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise ModelDirError(f"model dir {d}: no tokenizer.json or tokenizer.model")
    check_tokenizer_fits(d)
    return d


def check_tokenizer_fits(d: Path) -> None:
    """A tokenizer from another model hands out token ids the embedding does not have (vLLM
    would fail at the first request, or read past the table): its largest id must be below
    config.json's vocab_size. Only tokenizer.json is read (sentencepiece files are skipped)."""
    try:
        config = json.loads((d / "config.json").read_text())
    except ValueError as exc:
        raise ModelDirError(f"model dir {d}: config.json is not JSON: {exc}") from None
    vocab_size = (config.get("text_config") or config).get("vocab_size")
    tok_file = d / "tokenizer.json"
    if not isinstance(vocab_size, int) or not tok_file.is_file():
        return
    try:
        tok = json.loads(tok_file.read_text())
    except ValueError as exc:
        raise ModelDirError(f"model dir {d}: tokenizer.json is not JSON: {exc}") from None
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in tok.get("added_tokens") or [] if isinstance(t, dict)]
    top = max((i for i in ids if isinstance(i, int)), default=-1)
    if top >= vocab_size:
        raise ModelDirError(
            f"model dir {d}: tokenizer.json does not match the model: it has token id {top}, "
            f"config.json's vocab_size is {vocab_size} (a tokenizer from another model?)"
        )


def run_rank_hooks(plan: WorkerPlan, rank: int) -> InitHookSession | None:
    """The model's init hooks for one vLLM rank, in that rank's process, before its weights
    load (device index = the rank, as the builtin worker does); HookError fails closed."""
    if plan.init_hooks is None:
        return None
    return run_init_hooks(plan.init_hooks, plan.model_dir, [rank])


def checkpoint_plan(plan: WorkerPlan) -> WorkerPlan:
    """The plan the weightlift loaders see: one 'rank' holding the whole HF checkpoint, bytes as
    stored (vLLM casts while loading), whatever vLLM's tensor-parallel size is."""
    model = plan.model.model_copy(update={"dtype": "auto"})
    return plan.model_copy(update={"tensor_parallel": 1, "ranks": [0], "model": model})


@dataclass
class CheckpointLoad:
    tensors: dict[str, torch.Tensor]
    progress: LoadProgress
    strategy: str
    peer_failures: list[str] = field(default_factory=list)


def load_checkpoint(plan: WorkerPlan) -> CheckpointLoad:
    """The checkpoint's tensors in host memory: from a peer (checksums verified) when the plan
    says Target, else, or when every peer fails, from storage (preload or direct)."""
    cplan = checkpoint_plan(plan)
    progress = LoadProgress()
    failures: list[str] = []
    if wants_peer_to_peer(plan):  # the worker's one rule, for the checkpoint inside vLLM
        from weightlift.worker.loaders.p2p import PeerToPeerLoader

        p2p = PeerToPeerLoader()
        try:
            tensors = p2p.load(cplan, 0, CPU, progress)
            return CheckpointLoad(tensors, progress, "p2p")
        except LoadError as exc:
            failures = [str(f) for f in p2p.failures] or [str(exc)]
            log.warning("weightlift: P2P failed (%s); loading from storage", exc)
            progress.reset()
    loader = choose_storage_loader(cplan, {0: CPU})
    tensors = loader.load(cplan, 0, CPU, progress)
    progress.loaded_from = f"storage:{ModelUri.parse(plan.model.uri).scheme}"
    progress.finish()
    return CheckpointLoad(tensors, progress, loader.name, failures)


def write_report(report_dir: str | Path, report: EngineRankReport) -> Path:
    """Atomically (rename) write rank-<r>.json; the worker polls for it."""
    d = Path(report_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank-{report.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.wire()))
    os.replace(tmp, path)
    return path


def read_report(report_dir: str | Path, rank: int) -> EngineRankReport | None:
    path = Path(report_dir) / f"rank-{rank}.json"
    try:
        return EngineRankReport.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


class PublishedCheckpoint:
    """A SourcePublisher of the checkpoint plus a small HTTP server for its manifest routes,
    in a thread of this (vLLM) process: the NIXL agent must live where the memory is."""

    def __init__(self, plan: WorkerPlan, tensors: dict[str, torch.Tensor]) -> None:
        from aiohttp import web

        from weightlift.worker.p2p.source import SourcePublisher, p2p_app

        self.publisher = SourcePublisher(checkpoint_plan(plan), {0: tensors})
        self._loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._runner = web.AppRunner(p2p_app(self.publisher), access_log=None)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, self._sock).start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="wl-p2p-http", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise LoadError("the P2P manifest server did not start within 10 s")

    def close(self) -> None:
        def stop() -> None:
            self._loop.stop()

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=5)
        self.publisher.close()
