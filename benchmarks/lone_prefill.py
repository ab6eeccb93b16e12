"""Lone prompts, one at a time, offline: each request's time to its one token (the prefill
of --input-len tokens, eager, and the step around it). Run under a sampling profiler to see
where a lone prefill's host time goes.

    python benchmarks/lone_prefill.py --model benchmarks/configs/llama3-8b [--input-len 641]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--input-len", type=int, default=641)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, enforce_eager=args.enforce_eager)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(args.num_requests + 2):
        ids = [1 + (13 * i + 7 * j) % 30000 for j in range(args.input_len)]  # no prefix hits
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    times = times[2:]
    print(json.dumps({"input_len": args.input_len, "median_ms": 1e3 * statistics.median(times),
                      "min_ms": 1e3 * min(times)}))  # fmt: skip


if __name__ == "__main__":
    main()
