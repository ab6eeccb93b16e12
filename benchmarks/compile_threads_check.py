"""Start-up kernel compiles on threads vs one at a time: the greedy tokens of a few prompts
(dummy weights, token ids) after each, and how long the engine took to be ready.

Run it twice, each time with a fresh TRITON_CACHE_DIR, once with ASYNCSERVE_COMPILE_THREADS=1
and once without, and compare the printed tokens:

    TRITON_CACHE_DIR=/tmp/tc1 ASYNCSERVE_COMPILE_THREADS=1 \
        python benchmarks/compile_threads_check.py --model benchmarks/configs/llama3-8b
    TRITON_CACHE_DIR=/tmp/tc2 python benchmarks/compile_threads_check.py --model ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

from asyncserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    ready = time.perf_counter() - start
    prompts = [{"prompt_token_ids": [100 + i, 200 + 7 * i, 300, 400 + i]} for i in range(4)]
    prompts.append({"prompt_token_ids": list(range(1000, 1300))})  # a prefill graph's size
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    threads = os.environ.get("ASYNCSERVE_COMPILE_THREADS", "default")
    print(json.dumps({"threads": threads, "ready_s": round(ready, 2), "tokens": tokens}))


if __name__ == "__main__":
    main()
