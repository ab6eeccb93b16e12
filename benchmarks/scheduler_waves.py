"""W1b through the scheduler alone: how many steps and preemptions a KV pool size and
`max_num_seqs` give (no model: every scheduled request samples one token a step).

A pool that holds every sequence to its end runs the 1000 requests in as many waves as
max_num_seqs allows; a pool that does not preempts (by recompute) as decodes grow.

    python benchmarks/scheduler_waves.py --pool-gib 55 --max-num-seqs 512 1024

--pool-gib: the KV pool's size (Llama-3-8B: 128 KiB a token in bf16; an H100 80GB leaves
~55 GiB after the weights, an H200 ~118 GiB).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from asyncserve.core.request import Request  # noqa: E402
from asyncserve.core.scheduler import Scheduler  # noqa: E402
from asyncserve.core.step import StepResult  # noqa: E402
from asyncserve.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16


def run(args: argparse.Namespace, max_num_seqs: int) -> tuple[int, int, int]:
    """(steps, preemptions, pool blocks) of one pass over the workload."""
    num_blocks = int(args.pool_gib * 2**30 / (BLOCK * args.kv_bytes_per_token))
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_num_seqs
        ),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        num_blocks=num_blocks,
        max_model_len=args.max_model_len,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i in range(args.num_prompts):
        prompt = [(i * 7919 + j * 31) % 100000 + 1000 for j in range(args.input_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=args.output_len))
    steps = 0
    while True:
        plan = scheduler.schedule()
        if not plan.num_scheduled_tokens:
            break
        sampled = {request_id: [5] for request_id in plan.num_scheduled_tokens}
        scheduler.update(plan, StepResult(sampled_token_ids=sampled))
        steps += 1
    return steps, scheduler.num_preemptions_total, num_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=55.0)
    parser.add_argument("--kv-bytes-per-token", type=int, default=128 << 10)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    for seqs in args.max_num_seqs:
        steps, preemptions, blocks = run(args, seqs)
        print(f"pool {blocks} blocks ({blocks * BLOCK} tokens), max_num_seqs {seqs}: "
              f"{steps} steps, {preemptions} preemptions")  # fmt: skip


if __name__ == "__main__":
    main()
