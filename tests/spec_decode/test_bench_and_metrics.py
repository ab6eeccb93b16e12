"""`bench latency` reports the mean accepted length; /metrics has vLLM's spec_decode names."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from asyncserve.cli import build_parser
from asyncserve.config import CacheConfig, SchedulerConfig
from asyncserve.core.scheduler import Scheduler
from asyncserve.engine.engine_core import EngineCore
from asyncserve.metrics import EngineMetrics
from tests.spec_decode.test_ngram_engine import LETTERS


def test_bench_latency_reports_mean_accepted_length(gguf_path: Path, tmp_path: Path) -> None:
    from asyncserve.bench import latency

    prompt = tmp_path / "prompt.txt"
    prompt.write_text(LETTERS)
    out = tmp_path / "latency.json"
    args = build_parser().parse_args(
        ["bench", "latency", "--input-len", "64", "--output-len", "12", "--num-iters", "1",
         "--num-iters-warmup", "0", "--max-model-len", "256", "--prompt-file", str(prompt),
         "--output-json", str(out), "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    )  # fmt: skip
    report = latency.run(args)
    assert json.loads(out.read_text()) == report
    # The letters repeat: nearly every round accepts all three proposals.
    assert report["mean_accepted_length"] > 3.0, report


def test_metrics_count_drafts_and_accepted_tokens_per_position() -> None:
    metrics = EngineMetrics("m")
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=8, max_model_len=64)
    # Only the scheduler's counters are read after a step.
    core = EngineCore(scheduler, None, None, metrics)  # type: ignore[arg-type]
    scheduler.spec_stats.observe(4, 4)
    core._record_step(0)
    scheduler.spec_stats.observe(4, 1)
    core._record_step(0)
    text = generate_latest(metrics.registry).decode()
    assert 'asyncserve:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'asyncserve:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'asyncserve:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    per_pos = 'asyncserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position='
    assert per_pos + '"0"} 2.0' in text
    assert per_pos + '"3"} 1.0' in text
