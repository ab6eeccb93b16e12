"""Host time of the scheduler alone: schedule() and update() for a batch of decoding
requests, no model and no engine (the part of a step's loop work that grows with the batch).

    python benchmarks/scheduler_host.py [--batch-size 256] [--steps 400]

Prints the median microseconds per step of each, the best of three runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from asyncserve.core.request import Request  # noqa: E402
from asyncserve.core.scheduler import Scheduler  # noqa: E402
from asyncserve.core.step import StepResult  # noqa: E402
from asyncserve.sampling_params import SamplingParams  # noqa: E402


def run(batch: int, steps: int) -> tuple[float, float]:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(8192, batch),
            max_num_seqs=batch,
            decode_latency_target_ms=50.0,
        ),
        CacheConfig(block_size=16, enable_prefix_caching=True),
        num_blocks=batch * 32,
        max_model_len=4096,
    )
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = [(i * 7 + j) % 30000 for j in range(128)]
        scheduler.add_request(Request(f"r{i}", prompt, params, max_tokens=steps + 1))
    schedule_s: list[float] = []
    update_s: list[float] = []
    for k in range(steps):
        start = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        result = StepResult(sampled_token_ids={rid: [5] for rid in plan.num_scheduled_tokens})
        before_update = time.perf_counter()
        scheduler.update(plan, result)
        end = time.perf_counter()
        scheduler.record_step_time(plan.total_num_scheduled_tokens, 0.01)
        if k >= 20:  # past the prefills
            schedule_s.append(planned - start)
            update_s.append(end - before_update)
    return 1e6 * statistics.median(schedule_s), 1e6 * statistics.median(update_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    runs = [run(args.batch_size, args.steps) for _ in range(3)]
    print(f"batch {args.batch_size}: schedule {min(r[0] for r in runs):.1f} us, "
          f"update {min(r[1] for r in runs):.1f} us per step")  # fmt: skip


if __name__ == "__main__":
    main()
