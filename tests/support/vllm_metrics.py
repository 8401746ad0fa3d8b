"""vLLM 0.32's /metrics text, for tests that need no vLLM: `vllm_metrics.txt` beside this file is
what vLLM's own PrometheusStatLogger wrote (the registry vLLM's /metrics serves, less the HTTP
families its instrumentator adds: Python process families, then every `vllm:*` family with
labels model_name and engine; counters with their `_created` gauges, histograms with buckets)
after one recorded step (1 running request, 2
waiting, KV cache 25 % used, two times to first token).

Regenerate it in the vLLM environment, from the repository root:
    PYTHONPATH=. ~/.cache/weightlift/vllm-0.32.0/bin/python -m tests.support.vllm_metrics
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).with_name("vllm_metrics.txt")
SERVED_MODEL_NAME = "tiny"
HEADER = "# vLLM 0.32.0 /metrics, written by tests/support/vllm_metrics.py (see there)\n"


def exposition() -> str:
    return FIXTURE.read_text()


def _generate(model_dir: Path) -> str:  # pragma: no cover - runs in the vLLM environment
    import prometheus_client
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import get_prometheus_registry
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    from weightlift.local.llm import make_tiny_llama

    make_tiny_llama(model_dir)
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), served_model_name=SERVED_MODEL_NAME)
    )
    logger = PrometheusStatLogger(config, [0])
    iteration = IterationStats()
    iteration.time_to_first_tokens_iter = [0.03, 0.2]
    logger.record(
        SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.25), iteration
    )
    text: str = prometheus_client.generate_latest(get_prometheus_registry()).decode()
    return text


def main() -> None:  # pragma: no cover - runs in the vLLM environment
    with tempfile.TemporaryDirectory() as tmp:
        FIXTURE.write_text(HEADER + _generate(Path(tmp) / "tiny"))
    print(f"wrote {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
