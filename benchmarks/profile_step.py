"""Profile decode steps with the torch profiler: where a step's device and host time go."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from asyncserve import SamplingParams
from asyncserve.bench.workload import random_prompts
from asyncserve.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--sort", default=None, help="key_averages column (default: CUDA time)")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        max_model_len=2048,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=8192,
    )
    prompts = random_prompts(args.batch_size, args.input_len, llm.engine.loaded.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compile, capture
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    sort = args.sort or ("cuda_time_total" if torch.cuda.is_available() else "cpu_time_total")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
