"""A tiny random-weight Llama model in Hugging Face layout, made locally (no hub download).

`make_tiny_llama(DIR)` writes config.json, generation_config.json, model.safetensors (fp32,
`save_pretrained`) and a byte-level BPE tokenizer trained here with `tokenizers`, wrapped as
`PreTrainedTokenizerFast`. vLLM's CPU attention rejects head_dim 16, so heads are 64 wide.
Same seed, same bytes: greedy completions are deterministic across runs and processes.
Also written: `probe.json`, a completion probe whose expected text is the greedy continuation
computed here by transformers (an implementation independent of vLLM).

Needs transformers and tokenizers (the vLLM environment has both): run it there as
`python -m weightlift.local.llm DIR [--layers N --hidden H]`, or from the project's environment
through `make_in_engine_env`. `vllm_python()` finds (and `ensure_vllm_env()` builds, with
hack/install-vllm.sh) the separate vLLM environment under $WL_CACHE.

Only the standard library at import time: this module runs in both environments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightlift.api.model import Role
    from weightlift.api.worker import PeerCandidate, WorkerPlan

VLLM_VERSION = "0.32.0"
INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "install-vllm.sh"

# Text the tokenizer learns its merges from; any English will do, it only has to be stable.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights move from storage to memory and from peer to peer",
    "a model is ready only when it answers a real request",
    "hello world, hello weights, hello tensors and hello models",
    "one two three four five six seven eight nine ten",
    "large language models generate text one token at a time",
] * 20
VOCAB_SIZE = 512
PROBE_FILE = "probe.json"
PROBE_PROMPT = "hello world"
PROBE_TOKENS = 8


def make_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out))
    return len(fast)


def make_tiny_llama(out: str | Path, *, layers: int = 2, hidden: int = 256, seed: int = 0) -> Path:
    """Write the model to `out` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(d)
    heads = max(hidden // 64, 2)
    config = LlamaConfig(
        vocab_size=max(vocab, VOCAB_SIZE),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # random but not degenerate: greedy output varies with the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(d), safe_serialization=True)
    probe = {
        "prompt": PROBE_PROMPT,
        "maxTokens": PROBE_TOKENS,
        "expectedText": greedy_text(model, d, PROBE_PROMPT, PROBE_TOKENS),
    }
    (d / PROBE_FILE).write_text(json.dumps({"completion": probe}, indent=1))
    (d / "weightlift-model.json").write_text(
        json.dumps(
            {"maker": "weightlift.local.llm", "layers": layers, "hidden": hidden, "seed": seed},
            indent=1,
        )
    )
    return d


def vllm_env_dir() -> Path:
    cache = os.environ.get("WL_CACHE") or str(Path.home() / ".cache" / "weightlift")
    return Path(cache) / f"vllm-{VLLM_VERSION}"


def vllm_python() -> Path | None:
    """The vLLM environment's python: $WEIGHTLIFT_VLLM_PYTHON, else the cached build when it is
    complete (the install script's stamp), else None."""
    explicit = os.environ.get("WEIGHTLIFT_VLLM_PYTHON")
    if explicit:
        return Path(explicit)
    env = vllm_env_dir()
    python = env / "bin" / "python"
    return python if (env / ".engine-installed").is_file() and python.exists() else None


def ensure_vllm_env() -> Path:
    """Build the vLLM environment (minutes, ~6 GB, once) or re-point it at this checkout."""
    result = subprocess.run(
        ["bash", str(INSTALL_SCRIPT), str(vllm_env_dir())],
        check=False,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{INSTALL_SCRIPT} failed:\n{result.stdout[-3000:]}")
    return vllm_env_dir() / "bin" / "python"


TRITON_INSTALL_SCRIPT = INSTALL_SCRIPT.with_name("install-triton.sh")


def ensure_triton_env() -> Path:
    """Unpack tritonserver and its Python backend stubs (once), with numpy 1.x for the stub of
    the vLLM environment's Python; returns the install's home (WEIGHTLIFT_TRITON_HOME)."""
    cache = os.environ.get("WL_CACHE") or str(Path.home() / ".cache" / "weightlift")
    home = Path(os.environ.get("WEIGHTLIFT_TRITON_HOME") or Path(cache) / "triton-2.51")
    python = vllm_python() or vllm_env_dir() / "bin" / "python"
    result = subprocess.run(
        ["bash", str(TRITON_INSTALL_SCRIPT), str(home)],
        check=False,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ENGINE_PYTHON": str(python)},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{TRITON_INSTALL_SCRIPT} failed:\n{result.stdout[-3000:]}")
    return home


def make_in_engine_env(
    python: Path, out: Path, *, layers: int = 2, hidden: int = 256
) -> dict[str, Any]:
    """Make the tiny model with the vLLM environment's transformers; returns its probe.json."""
    if not (out / PROBE_FILE).is_file():
        subprocess.run(
            [
                str(python),
                "-m",
                "weightlift.local.llm",
                str(out),
                "--layers",
                str(layers),
                "--hidden",
                str(hidden),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    readable_by_all(out)
    probe: dict[str, Any] = json.loads((out / PROBE_FILE).read_text())
    return probe


def readable_by_all(root: Path) -> None:
    """Let every user read the model (directories: enter): transformers' save_pretrained writes
    model.safetensors 0600 (a temp file renamed), and a real node's worker (uid 1000) reads the
    hostPath with its own uid, not root's."""
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        want = mode | (0o555 if path.is_dir() else 0o444)
        if want != mode:
            path.chmod(want)


def greedy_text(model: Any, model_dir: Path, prompt: str, max_tokens: int) -> str:
    """transformers' greedy continuation of `prompt`, decoded (the probe's expected text)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return str(tok.decode(out[0, ids.shape[1] :]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_tiny_llama(args.out, layers=args.layers, hidden=args.hidden, seed=args.seed))


if __name__ == "__main__":
    main()


def vllm_worker_plan(
    model: Path,
    pod: str,
    role: Role,
    peers: list[PeerCandidate],
    engine_args: list[str],
    *,
    tp: int = 1,
    deployment: str = "llm",
    identity: str = "llm-tiny",
    triton: bool = False,
) -> WorkerPlan:
    """A WorkerPlan for the tiny LLM served by vLLM on this machine (CPU, loopback, free
    ports), as the vLLM and Triton tests and benches run a worker without the operator
    (`triton`: runtime.engine Triton, with its gRPC and metrics ports). The model
    dir is the same path string on every replica: it is part of vLLM's compile cache key."""
    from weightlift.api.model import Engine, ModelFormat, ModelSource, RuntimeSpec
    from weightlift.api.worker import WorkerPlan
    from weightlift.local.net import free_port

    return WorkerPlan(
        tensor_parallel=tp,
        ranks=list(range(tp)),
        deployment=deployment,
        pod_name=pod,
        role=role,
        peers=peers,
        model_identity=identity,
        model=ModelSource(uri=f"file://{model}", format=ModelFormat.SAFETENSORS),
        model_dir=str(model),
        served_model_name="llm",
        device="cpu",
        host="127.0.0.1",
        runtime=RuntimeSpec(
            engine=Engine.TRITON if triton else Engine.VLLM,
            port=free_port(),
            engine_port=free_port(),
            **(
                {"engine_grpc_port": free_port(), "engine_metrics_port": free_port()}
                if triton
                else {}
            ),
            engine_args=engine_args,
        ),
    )
