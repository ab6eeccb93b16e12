"""W6: TTFT with and without prefix caching for requests sharing a long prefix.

200 requests = one shared 2000-token prefix + 100 unique tokens each, 64 output tokens,
submitted together to the engine; TTFT is measured per request inside the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics

from asyncserve import RequestOutputKind, SamplingParams
from asyncserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asyncserve.engine.async_engine import AsyncEngine


async def run_once(args: argparse.Namespace, prefix_caching: bool) -> dict[str, float]:
    config = EngineConfig(
        model=ModelConfig(model=args.model, load_format="dummy", max_model_len=4096),
        cache=CacheConfig(enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
    )
    engine = AsyncEngine.from_config(config)
    await engine.start()
    vocab = engine.loaded.arch.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(1000, vocab) for _ in range(args.prefix_len)]
    prompts = [
        prefix + [rng.randrange(1000, vocab) for _ in range(args.unique_len)]
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(i: int) -> float:
        final = None
        async for out in engine.generate(prompts[i], params, f"r{i}"):
            final = out
        assert final is not None
        return final.metrics["ttft_s"]

    ttfts = await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    await engine.shutdown()
    return {"ttft_median_s": statistics.median(ttfts), "ttft_mean_s": statistics.fmean(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--unique-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    report = {}
    for enabled in (False, True):
        report["with" if enabled else "without"] = asyncio.run(run_once(args, enabled))
        print(
            ("with" if enabled else "without"),
            "prefix caching:",
            report["with" if enabled else "without"],
            flush=True,
        )
    ratio = report["with"]["ttft_median_s"] / report["without"]["ttft_median_s"]
    print(json.dumps({**report, "median_ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
