"""Ray benchmarks (GPU): Ray Data replicas, and the Ray executor against the multiprocess one.

  data      W1b's prompts (random token ids, 256 in / 256 out, EOS ignored) through ray.data
            with 1 replica, then 2 (one GPU each), one batch per replica: total tok/s over
            the generate calls (the longest batch's time_taken_llm: the replicas run at once,
            and loading the model is left out) and end to end, and the speed-up
  executor  W2 (batch 1, 128 in / 256 out, greedy) at tensor_parallel_size 2 with
            distributed_executor_backend "mp", then "ray", alternating: ms per output token
            and the Ray executor's overhead
  pipeline  W1b's prompts (--input-len in / --output-len out, EOS ignored) through the Ray
            executor at pipeline_parallel_size 2 (one stage per GPU, one micro-batch per
            stage in flight), then 1 (one GPU): total tok/s, the speed-up, and how many
            steps the engine kept in flight

    python benchmarks/ray_bench.py data --model benchmarks/configs/llama3-8b --out $OUT/ray_data.json
    python benchmarks/ray_bench.py executor --model benchmarks/configs/llama3-8b --out $OUT/ray_exec.json
    python benchmarks/ray_bench.py pipeline --model benchmarks/configs/llama3-8b --out $OUT/ray_pp.json

Weights are dummy (random), as in the other W1b / W2 runs. Both need two GPUs. The GPU
machine has no Ray: benchmarks/ray_wheels.sh packs it in two parts for two calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from asyncserve import LLM, SamplingParams
from asyncserve.bench.workload import random_prompts


def _vocab(model: str) -> int:
    with open(f"{model}/config.json") as f:
        return int(json.load(f)["vocab_size"])


def bench_data(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from asyncserve.ray_data import LLMProcessorConfig, build_llm_processor

    prompts = random_prompts(args.num_prompts, 256, _vocab(args.model))
    ray.init(include_dashboard=False)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    engine = {"load_format": "dummy", "max_model_len": 2048, "enable_prefix_caching": False}
    report: dict[str, Any] = {"num_prompts": args.num_prompts, "runs": {}}
    for replicas in (1, 2):
        config = LLMProcessorConfig(
            model_source=args.model,
            engine_kwargs=engine,
            concurrency=replicas,
            batch_size=args.num_prompts // replicas,
        )
        processor = build_llm_processor(config, sampling_params=params)
        ds = ray.data.from_items([{"prompt_token_ids": p} for p in prompts])
        start = time.perf_counter()
        rows = processor(ds).take_all()
        wall = time.perf_counter() - start
        tokens = sum(r["num_input_tokens"] + r["num_generated_tokens"] for r in rows)
        generate = max(r["time_taken_llm"] for r in rows)
        report["runs"][replicas] = {
            "generate_s": generate,
            "wall_s": wall,
            "total_tok_per_s": tokens / generate,
            "wall_tok_per_s": tokens / wall,
            "batches": len({r["time_taken_llm"] for r in rows}),
        }
        print(
            f"{replicas} replica(s): {tokens / generate:,.0f} total tok/s in generate "
            f"({generate:.1f} s), {tokens / wall:,.0f} end to end ({wall:.1f} s)"
        )
    one, two = (report["runs"][n]["total_tok_per_s"] for n in (1, 2))
    report["speedup"] = two / one
    print(f"2 replicas vs 1: {report['speedup']:.2f}x (goal >= 1.85x)")
    return report


def _w2(llm: LLM, prompts: list[list[int]], iters: int) -> float:
    """ms per output token as `bench latency` measures it (whole run minus prefill)."""
    full = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    runs, prefills = [], []
    for _ in range(iters):
        start = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        prefills.append(time.perf_counter() - start)
    return (statistics.fmean(runs) - statistics.fmean(prefills)) / 255 * 1e3


def bench_executor(args: argparse.Namespace) -> dict[str, Any]:
    prompts = random_prompts(1, 128, _vocab(args.model))
    results: dict[str, list[float]] = {"mp": [], "ray": []}
    for _ in range(args.rounds):
        for backend in ("mp", "ray"):
            llm = LLM(
                args.model,
                load_format="dummy",
                max_model_len=2048,
                enable_prefix_caching=False,
                tensor_parallel_size=2,
                distributed_executor_backend=backend,
            )
            try:
                ms = _w2(llm, prompts, args.iters)
            finally:
                llm.close()
            results[backend].append(ms)
            print(f"{backend}: {ms:.3f} ms per output token")
    mp, ray_ms = (statistics.median(results[b]) for b in ("mp", "ray"))
    overhead = ray_ms / mp - 1.0
    print(f"Ray executor overhead at TP=2, W2: {overhead * 100:+.2f}% (goal <= 3%)")
    return {"ms_per_output_token": results, "overhead": overhead}


def bench_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    prompts = random_prompts(args.num_prompts, args.input_len, _vocab(args.model))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    device = {"device": args.device} if args.device else {}
    report: dict[str, Any] = {"num_prompts": args.num_prompts, "runs": {}}
    for pp in (2, 1):
        llm = LLM(
            args.model,
            load_format="dummy",
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
            pipeline_parallel_size=pp,
            distributed_executor_backend="ray",
            **device,  # type: ignore[arg-type]
        )
        try:
            llm.generate(prompts[:8], warm, use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            in_flight = llm.engine.step_loop.max_in_flight
        finally:
            llm.close()
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        report["runs"][pp] = {
            "seconds": elapsed,
            "total_tok_per_s": tokens / elapsed,
            "output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "max_steps_in_flight": in_flight,
        }
        print(
            f"PP={pp}: {tokens / elapsed:,.0f} total tok/s ({elapsed:.1f} s), "
            f"up to {in_flight} step(s) in flight"
        )
    report["speedup"] = report["runs"][2]["total_tok_per_s"] / report["runs"][1]["total_tok_per_s"]
    print(f"PP=2 vs PP=1: {report['speedup']:.2f}x")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["data", "executor", "pipeline"])
    parser.add_argument("--model", required=True, help="a config directory (dummy weights)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="executor: mp/ray alternations")
    parser.add_argument("--iters", type=int, default=3, help="executor: timed runs per engine")
    parser.add_argument("--input-len", type=int, default=256, help="pipeline: prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="pipeline: output tokens")
    parser.add_argument("--max-model-len", type=int, default=2048, help="pipeline")
    parser.add_argument("--device", default=None, help="pipeline: cpu for a small check")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args()
    benches = {"data": bench_data, "executor": bench_executor, "pipeline": bench_pipeline}
    report = benches[args.what](args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
