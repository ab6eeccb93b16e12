"""Where a decode step's wall time goes, phase by phase (for small batches, where the host
work between device steps bounds the figure).

Times, per decode step (medians, microseconds): the step period (one scheduler update to
the next), the scheduler's plan and update, the runner's execute on the step thread split
into building the inputs, launching the forward (graph replay or eager), the sampling
metadata, the sampler's launch, and collecting the sampled ids (which waits for the
device); the hand-offs between the event loop and the step thread; publishing outputs.
On CUDA it also times one graph replay alone (the device's share of the step).

    python benchmarks/step_phases.py --model benchmarks/configs/llama3-8b --load-format dummy \
        [--batch-size 1] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import SamplingParams  # noqa: E402
from asyncserve.bench.workload import random_prompts  # noqa: E402
from asyncserve.engine import model_runner  # noqa: E402
from asyncserve.llm import LLM  # noqa: E402
from benchmarks.timing import Timer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)"
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    # One step at a time: the phases below are those the device would wait for without
    # async scheduling (with it, they run while the step before computes).
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        async_scheduling=False,
    )
    engine = llm.engine
    runner = engine.runner
    prompts = random_prompts(args.batch_size, args.input_len, engine.loaded.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compile, capture

    timers: dict[str, Timer] = {
        "schedule": Timer(engine.scheduler.schedule),
        "update": Timer(engine.scheduler.update),
        "forward": Timer(runner.launch_forward),
        "build_inputs": Timer(model_runner.build_step_inputs),
        "sampling_meta": Timer(model_runner.SamplingMetadata.build),
        "sampler": Timer(runner.sampler),
        "collect": Timer(runner.collect),
        "publish": Timer(engine.core.publish),
    }
    if runner.decode_graphs is not None:
        timers["replay"] = Timer(runner.decode_graphs.run)
    marks: dict[str, list[float]] = {"execute_start": [], "execute_end": [], "update_start": []}
    # A step runs from its forward stage to the end of its collect stage.
    forward = timers["forward"]
    collect = timers["collect"]

    def marked_forward(*a: Any) -> Any:
        marks["execute_start"].append(time.perf_counter())
        return forward(*a)

    def marked_collect(*a: Any) -> Any:
        try:
            return collect(*a)
        finally:
            marks["execute_end"].append(time.perf_counter())

    update = timers["update"]

    def marked_update(*a: Any) -> Any:
        marks["update_start"].append(time.perf_counter())
        return update(*a)

    schedule_end: list[float] = []
    schedule = timers["schedule"]

    def marked_schedule(*a: Any) -> Any:
        try:
            return schedule(*a)
        finally:
            schedule_end.append(time.perf_counter())

    engine.scheduler.schedule = marked_schedule  # type: ignore[method-assign]
    engine.scheduler.update = marked_update  # type: ignore[method-assign]
    runner.launch_forward = marked_forward  # type: ignore[method-assign]
    model_runner.build_step_inputs = timers["build_inputs"]  # type: ignore[attr-defined]
    meta_build = model_runner.SamplingMetadata.build
    model_runner.SamplingMetadata.build = timers["sampling_meta"]  # type: ignore[method-assign]
    runner.sampler = timers["sampler"]  # type: ignore[assignment]
    runner.collect = marked_collect  # type: ignore[method-assign]
    engine.core.publish = timers["publish"]  # type: ignore[method-assign]
    if runner.decode_graphs is not None:
        runner.decode_graphs.run = timers["replay"]  # type: ignore[method-assign]
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        model_runner.SamplingMetadata.build = meta_build  # type: ignore[method-assign]

    skip = 2  # the prefill step and the first decode step
    updates = marks["update_start"]

    def us(values: list[float]) -> float:
        tail = values[skip:]
        return 1e6 * statistics.median(tail) if tail else float("nan")

    period = [b - a for a, b in zip(updates, updates[1:], strict=False)]
    # Hand-offs: each execute start after the schedule that planned it, and each update
    # after the execute that produced its result.
    to_thread = [
        start - schedule_end[bisect.bisect_left(schedule_end, start) - 1]
        for start in marks["execute_start"]
    ]
    ends = marks["execute_end"]
    to_loop = [u - ends[bisect.bisect_left(ends, u) - 1] for u in updates]
    print(f"batch {args.batch_size}, {args.output_len} tokens, device {engine.device}")
    print(f"{'step period':>22}: {us(period):9.1f} us")
    for name, timer in timers.items():
        print(f"{name:>22}: {us(timer.times):9.1f} us")
    print(f"{'loop -> step thread':>22}: {us(to_thread):9.1f} us")
    print(f"{'step thread -> loop':>22}: {us(to_loop):9.1f} us")
    graphs = runner.decode_graphs
    if graphs is not None and torch.cuda.is_available():
        size = graphs.padded_size(args.batch_size)
        graph, _ = graphs.graphs[size]  # type: ignore[index]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        device_us = (time.perf_counter() - start) / 50 * 1e6
        print(f"{'graph replay (device)':>22}: {device_us:9.1f} us")
        print(f"{'host share of a step':>22}: {us(period) - device_us:9.1f} us")
    llm.close()


if __name__ == "__main__":
    main()
