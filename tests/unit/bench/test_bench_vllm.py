"""`bench vllm`'s mode switch and table (the runs themselves need vLLM: `weightlift bench vllm`)."""

from __future__ import annotations

import pytest

from weightlift.bench.vllm import _print
from weightlift.local.stack import VLLM_EAGER, VLLM_ENGINE_ARGS, vllm_engine_args


def test_compiled_mode_drops_only_enforce_eager() -> None:
    compiled = vllm_engine_args(eager=False)
    assert VLLM_EAGER not in compiled
    assert compiled == [a for a in VLLM_ENGINE_ARGS if a != VLLM_EAGER]
    assert vllm_engine_args(eager=True).count(VLLM_EAGER) == 1


def test_the_table_shows_init_seconds_tokens_per_second_and_the_cache_outcome(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = {
        "auto": {"ready_s": 50.0, "load_s": 0.5, "from": "storage", "init_s": 17.8, "tok_s": 40.0},
        "p2p+cache": {
            "ready_s": 25.0,
            "load_s": 0.3,
            "gbps": 0.5,
            "from": "peer:bench-source",
            "init_s": 3.0,
            "tok_s": 41.0,
            "compile_cache": "hit",
        },
    }
    _print(rows, 155_000_000, 1024, 4, "compiled")
    out = capsys.readouterr().out.splitlines()
    assert "vLLM compiled" in out[0] and "compile cache" in out[1]
    cached = next(line for line in out if line.startswith("p2p+cache"))
    assert cached.split()[1:] == [
        "peer:bench-source",
        "25.0",
        "2.00",
        "0.300",
        "0.50",
        "3.0",
        "41.0",
        "hit",
    ]
