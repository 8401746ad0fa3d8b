"""What the worker and the vLLM load format's ranks exchange, free of torch and vLLM: the worker
(its front process) imports only this, so it starts vLLM without importing torch first.

The load format's options (`--model-loader-extra-config`), each rank's report file (the
worker polls it) and the model-directory checks both sides make.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from weightlift.api.model import ApiModel
from weightlift.api.worker import HookReport, WorkerPlan
from weightlift.worker.loaders.strategy import wants_peer_to_peer
from weightlift.worker.storage.fetch import is_remote
from weightlift.worker.weights.progress import LoadError

LOAD_FORMAT = "weightlift"
# Standby: beyond the worker's own bound on the hand-off (worker/standby.py), how long a rank
# also waits for the worker's compile-cache fetch before it relays the hand-off.
RELAY_MARGIN_SECONDS = 120.0


# "0": a vLLM standby target or spare waits for its weights before vLLM compiles (the old way).
COMPILE_FIRST_ENV = "WEIGHTLIFT_VLLM_COMPILE_FIRST"


def compiles_before_weights(environ: Mapping[str, str], plan: WorkerPlan) -> bool:
    """Whether a vLLM standby pod compiles and warms up before its weights: a warm spare does,
    unless the pod's environment says "0" or vLLM runs eager (`--enforce-eager`: nothing to
    compile). Outputs are bit-identical either way (docs/early-compile); what changes is where
    the compile falls: before the hand-off, without any peer's compile cache (none is known
    yet), instead of after it with the peer's. A spare waits long enough for its own compile
    to be done when it is woken; a standby target created with its source gets its hand-off as
    soon as the source is Ready, and then installing the source's program beats compiling."""
    args = plan.runtime.engine_args
    eager = any(a == "--enforce-eager" or a.startswith("--enforce-eager=") for a in args)
    return bool(plan.spare) and environ.get(COMPILE_FIRST_ENV, "1") != "0" and not eager


class ModelDirError(LoadError):
    """The model directory cannot be served by vLLM (permanent: the files are wrong)."""

    permanent = True


class EngineLoadOptions(ApiModel):
    """`--model-loader-extra-config` of the weightlift load format (camelCase JSON)."""

    plan: str = Field(description="Path of the WorkerPlan JSON file.")
    report_dir: str = Field(description="Where each rank writes rank-<r>.json.")
    handoff: str | None = Field(
        None,
        description="Standby: the file the worker relays the pod's hand-off to (peers or "
        "storage, worker/standby.py), once it has installed the peer's compile cache; each "
        "rank's weight step waits for it. None: load with the plan's peers at once.",
    )
    compile_first: bool = Field(
        False,
        description="Standby only: the ranks let vLLM compile and warm up on placeholder "
        "weights first, then wait for the relayed hand-off and put the weights in place "
        "(engines/vllm/inplace.py). An unquantized model only: a quantized one waits at its "
        "weight step as before.",
    )


class EngineRankReport(ApiModel):
    """What one vLLM rank says about its load; the worker folds it into its WorkerReport.

    Written when vLLM reaches the weight load (stage "loading", so the worker can show where
    vLLM is; "standby" while a standby rank waits for its hand-off) and when the weights are
    loaded and processed (stage "done"), or on failure.
    """

    rank: int
    ok: bool
    stage: str = "done"  # loading | standby | done
    # Standby with placeholder weights: vLLM compiles and warms up meanwhile; the worker relays
    # the hand-off once vLLM answers /health (the weights go in while vLLM is idle).
    compiles_first: bool = False
    message: str = ""
    permanent: bool = False  # retrying cannot help (bad files, a missing hook symbol)
    strategy: str = ""
    loaded_from: str = ""
    bytes_loaded: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    peer_failures: list[str] = Field(default_factory=list)
    # The transport UCX named for this rank's pull, and why it was given up (LoadProgress).
    transport: str = ""
    transport_note: str = ""
    # 127.0.0.1:port of this rank's P2P manifest server; the worker proxies to it.
    manifest_address: str | None = None
    # A Source rank checksums and registers its parameters beside vLLM's post-load processing
    # and compile; the worker waits for this to clear before it calls the replica Ready.
    publishing: bool = False
    hooks: list[HookReport] = Field(default_factory=list)
    # Wall clock (Unix seconds) at which each step of this rank ended: engine (vLLM started and
    # initialized up to its weight load), hooks, standby (model built, waiting for the hand-off)
    # and peers (handed), load (checkpoint in memory), processed (vLLM's load_weights and
    # post-load processing done).
    timeline: dict[str, float] = Field(default_factory=dict)
    load_phases: dict[str, float] = Field(default_factory=dict)
    finished_at: float = Field(default_factory=time.time)


def holds_weights(plan: WorkerPlan) -> bool:
    """Whether the plan's model dir has the weights: not for an s3:// or hf:// Target, whose
    worker fetched only the small files (it pulls its weights; `load_rank` downloads them on a
    peer failure)."""
    return not (is_remote(plan) and wants_peer_to_peer(plan))


def has_weights(model_dir: str | Path) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def check_model_dir(model_dir: str | Path, *, weights: bool = True) -> Path:
    """An HF model directory vLLM can serve: config.json, tokenizer, *.safetensors (unless
    `weights` is False: they come later)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(f"model dir {d} does not exist or is not a directory")
    if not (d / "config.json").is_file():
        raise ModelDirError(f"model dir {d}: config.json not found (an HF model directory)")
    if weights and not has_weights(d):
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
