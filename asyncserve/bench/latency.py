"""Latency of one batch end to end, as vLLM's `bench latency`: ms per output token."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from asyncserve.bench.workload import add_parallel_arguments, random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None, help="e.g. fp8 (as in serve)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=512)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan each step while the one before runs (default: on with CUDA)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    add_parallel_arguments(parser)
    parser.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding as JSON (as serve takes it); the report adds the mean "
        "accepted length",
    )
    parser.add_argument(
        "--prompt-file",
        default=None,
        help="a text file used as every prompt (cut to --input-len tokens) instead of random "
        "tokens; speculation needs text whose continuation it can predict",
    )
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncserve import SamplingParams
    from asyncserve.engine.async_engine import AsyncEngine
    from asyncserve.llm import LLM

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        speculative_config=args.speculative_config,
    )
    vocab = llm.engine.loaded.arch.vocab_size
    prompts: list[Any]
    if args.prompt_file:
        with open(args.prompt_file) as f:
            ids = llm.get_tokenizer().encode(f.read())[: args.input_len]
        prompts = [{"prompt_token_ids": ids}] * args.batch_size
    else:
        prompts = random_prompts(args.batch_size, args.input_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert isinstance(engine, AsyncEngine)  # one engine: no data parallelism here
    stats = engine.scheduler.spec_stats
    drafts, accepted = stats.num_drafts, stats.num_accepted_tokens
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    # Decode time per token: the whole run minus a prefill-only run, over the decode steps.
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        prefill.append(time.perf_counter() - start)
    mean = statistics.fmean(latencies)
    per_token = (mean - statistics.fmean(prefill)) / max(1, args.output_len - 1)
    report = {
        "latency_mean_s": mean,
        "latency_median_s": statistics.median(latencies),
        "prefill_s": statistics.fmean(prefill),
        "ms_per_output_token": per_token * 1e3,
        "output_tokens_per_s": args.batch_size * args.output_len / mean,
        "device": str(llm.engine.device),
    }
    summary = (
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out: "
        f"{mean * 1e3:.1f} ms per request, {report['ms_per_output_token']:.2f} ms per output token"
    )
    if args.speculative_config:
        # Tokens per verification round in the timed runs: accepted proposals plus one.
        rounds = stats.num_drafts - drafts
        length = 1.0 + (stats.num_accepted_tokens - accepted) / rounds if rounds else 1.0
        report["mean_accepted_length"] = length
        report["acceptance_rate"] = stats.acceptance_rate
        summary += f", mean accepted length {length:.2f}"
    print(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report
