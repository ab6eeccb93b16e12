"""Where a decode step's wall time goes, phase by phase (the host work between device steps,
which bounds small batches and grows with large ones).

Times, per full decode step (medians over the steps where every request decodes one token,
microseconds): the step period (one scheduler update to the next); the scheduler's plan and
the core's update (stop rules, metrics); on the step thread the runner applying the plan,
building the inputs, launching the forward (the model's own share is what remains of
"forward" after those two), the sampling rows, the sampling metadata, the sampler's launch,
marking the placeholders and starting the copy, and collecting the sampled ids (which waits
for the device); the hand-offs between the event loop and the step thread; publishing
outputs (detokenizing, stop strings, request outputs). On CUDA it also times one graph
replay alone (the device's share of the step).

    python benchmarks/step_phases.py --model benchmarks/configs/llama3-8b --load-format dummy \
        [--batch-size 1] [--input-len 128] [--output-len 128] [--max-num-seqs N] \
        [--no-detokenize]

--async-scheduling: the engine's CUDA default (a step launched before the last one's tokens
are back), where a slow host step shows only when it outlasts the device's; --slowest N
then lists the N longest step periods with every timed call that started in each.

--no-detokenize: token ids only (SamplingParams(detokenize=False)), as the side-by-side
comparison runs vLLM. "publish, whole run" adds up every publish of the timed run: work a
request defers to its end (offline outputs are read only then) leaves the median step but
not this total.

Host time at large batch, on the CPU with a tiny model (the host's Python is the same):

    python benchmarks/step_phases.py --model benchmarks/configs/llama-tiny --load-format dummy \
        --batch-size 1024 --input-len 128 --output-len 48
"""

from __future__ import annotations

import argparse
import bisect
import collections
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import SamplingParams  # noqa: E402
from asyncserve.bench.workload import random_prompts  # noqa: E402
from asyncserve.llm import LLM  # noqa: E402
from asyncserve.worker import model_runner  # noqa: E402
from benchmarks.timing import Timer  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: max(8192, the batch size)")  # fmt: skip
    parser.add_argument("--no-detokenize", action="store_true", help="token ids only")
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)"
    )
    parser.add_argument("--async-scheduling", action="store_true", help="as the engine on CUDA")
    parser.add_argument("--slowest", type=int, default=0, help="list the N longest periods")
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: count the timed run's synchronizing calls by where asyncserve made them",
    )
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    batch = args.batch_size
    # By default one step at a time: the phases below are those the device would wait for
    # without async scheduling (with it, they run while the step before computes).
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or max(batch, 1),
        max_num_batched_tokens=args.max_num_batched_tokens or max(8192, batch),
        async_scheduling=args.async_scheduling,
    )
    engine = llm.engine
    runner = engine.runner
    core = engine.core
    prompts = random_prompts(batch, args.input_len, engine.loaded.arch.vocab_size)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        detokenize=not args.no_detokenize,
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compile, capture

    timers: dict[str, Timer] = {
        "schedule": Timer(core.schedule),
        "update": Timer(core.update),
        "  scheduler.update": Timer(engine.scheduler.update),
        "forward": Timer(runner.launch_forward),
        "  apply_plan": Timer(model_runner.apply_plan),
        "  build_inputs": Timer(model_runner.build_step_inputs),
        "sample": Timer(runner._sample),
        "  sampling_meta": Timer(model_runner.SamplingMetadata.build),
        "  sampler": Timer(runner.sampler),
        "start_copy": Timer(runner._start_copy),
        "collect": Timer(runner.collect),
        "publish": Timer(core.publish),
    }
    if runner.decode_graphs is not None:
        timers["replay"] = Timer(runner.decode_graphs.run)
    marks: dict[str, list[float]] = {"execute_start": [], "execute_end": [], "update_start": []}
    # Which launched steps were full decode steps (every request, one token each).
    full_decode: list[bool] = []
    forward, collect, update = timers["forward"], timers["collect"], timers["update"]

    def marked_forward(plan: Any, *a: Any) -> Any:
        marks["execute_start"].append(time.perf_counter())
        counts = plan.num_scheduled_tokens
        full_decode.append(len(counts) == batch and plan.total_num_scheduled_tokens == batch)
        return forward(plan, *a)

    def marked_collect(*a: Any) -> Any:
        try:
            return collect(*a)
        finally:
            marks["execute_end"].append(time.perf_counter())

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

    core.schedule = marked_schedule  # type: ignore[method-assign]
    core.update = marked_update  # type: ignore[method-assign]
    engine.scheduler.update = timers["  scheduler.update"]  # type: ignore[method-assign]
    runner.launch_forward = marked_forward  # type: ignore[method-assign]
    model_runner.apply_plan = timers["  apply_plan"]  # type: ignore[attr-defined]
    model_runner.build_step_inputs = timers["  build_inputs"]  # type: ignore[attr-defined]
    meta_build = model_runner.SamplingMetadata.build
    model_runner.SamplingMetadata.build = timers["  sampling_meta"]  # type: ignore[method-assign]
    runner._sample = timers["sample"]  # type: ignore[method-assign]
    runner.sampler = timers["  sampler"]  # type: ignore[assignment]
    runner._start_copy = timers["start_copy"]  # type: ignore[method-assign]
    runner.collect = marked_collect  # type: ignore[method-assign]
    core.publish = timers["publish"]  # type: ignore[method-assign]
    if runner.decode_graphs is not None:
        runner.decode_graphs.run = timers["replay"]  # type: ignore[method-assign]
    syncs = _watch_syncs() if args.sync_debug and torch.cuda.is_available() else None
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        if syncs is not None:
            torch.cuda.set_sync_debug_mode(0)
        model_runner.SamplingMetadata.build = meta_build  # type: ignore[method-assign]
        model_runner.apply_plan = timers["  apply_plan"].fn  # type: ignore[attr-defined]
    _report(args, engine, timers, marks, schedule_end, full_decode)
    if args.slowest:
        _slowest(args.slowest, timers, marks["update_start"])
    if syncs is not None:
        print(f"synchronizing CUDA calls in the timed run: {sum(syncs.values())}")
        for where, count in syncs.most_common(12):
            print(f"{count:8d}  {where}")
    llm.close()


def _watch_syncs() -> collections.Counter[str]:
    """torch's sync debug mode on, each warning counted by the innermost asyncserve frames
    that led to it (a host wait inside a step keeps the device idle under async scheduling)."""
    counts: collections.Counter[str] = collections.Counter()

    def record(message: Any, category: Any, *_: Any, **__: Any) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if "/asyncserve/" in f.filename]
        counts[
            " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:4])
        ] += 1

    warnings.simplefilter("always")
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    return counts


def _slowest(count: int, timers: dict[str, Timer], updates: list[float]) -> None:
    """The `count` longest step periods (update to update) of the timed run, each with the
    timed calls that started inside it: where a host stall between steps went."""
    calls = sorted(
        (start, name.strip(), took)
        for name, timer in timers.items()
        for start, took in zip(timer.starts, timer.times, strict=False)
    )
    periods = sorted(range(len(updates) - 1), key=lambda i: updates[i + 1] - updates[i])[::-1]
    median = statistics.median(b - a for a, b in zip(updates, updates[1:], strict=False))
    print(f"slowest step periods (median {1e6 * median:.0f} us):")
    for i in sorted(periods[:count]):
        begin, end = updates[i], updates[i + 1]
        print(f"  step {i}: {1e6 * (end - begin):.0f} us")
        lo = bisect.bisect_left(calls, (begin,))
        hi = bisect.bisect_left(calls, (end,))
        for start, name, took in calls[lo:hi]:
            print(f"    +{1e6 * (start - begin):7.0f} us  {name:<14} {1e6 * took:7.0f} us")


def _report(
    args: argparse.Namespace,
    engine: Any,
    timers: dict[str, Timer],
    marks: dict[str, list[float]],
    schedule_end: list[float],
    full_decode: list[bool],
) -> None:
    # The first full decode step still warms up; steps after it count (publish lags one
    # step behind, which changes nothing in steady state).
    first = full_decode.index(True) + 1 if any(full_decode) else len(full_decode)
    num_steps = sum(full_decode[first:])
    updates = marks["update_start"]

    def us(values: list[float]) -> float:
        tail = values[first:]
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
    sample_rows = [
        s - m - x
        for s, m, x in zip(
            timers["sample"].times,
            timers["  sampling_meta"].times,
            timers["  sampler"].times,
            strict=False,
        )  # fmt: skip
    ]
    print(
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out, "
        f"{num_steps} full decode steps, device {engine.device}"
    )
    sample_rows_cpu = [
        s - m - x
        for s, m, x in zip(
            timers["sample"].cpu_times,
            timers["  sampling_meta"].cpu_times,
            timers["  sampler"].cpu_times,
            strict=False,
        )  # fmt: skip
    ]
    print(f"{'':>22}  {'wall':>9}    {'thread CPU':>10}")
    print(f"{'step period':>22}: {us(period):9.1f} us")
    for name, timer in timers.items():
        print(f"{name:>22}: {us(timer.times):9.1f} us {us(timer.cpu_times):9.1f} us")
        if name == "sample":
            print(
                f"{'  sampling_rows':>22}: {us(sample_rows):9.1f} us {us(sample_rows_cpu):9.1f} us"
            )
    publish_ms = 1e3 * sum(timers["publish"].times)
    print(f"{'publish, whole run':>22}: {publish_ms:9.1f} ms")
    print(f"{'loop -> step thread':>22}: {us(to_thread):9.1f} us")
    print(f"{'step thread -> loop':>22}: {us(to_loop):9.1f} us")
    runner = engine.runner
    graphs = runner.decode_graphs
    size = graphs.padded_size(args.batch_size) if graphs is not None else None
    if graphs is not None and size is not None and torch.cuda.is_available():
        graph, _ = graphs.graphs[size]  # type: ignore[index]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        device_us = (time.perf_counter() - start) / 50 * 1e6
        print(f"{'graph replay (device)':>22}: {device_us:9.1f} us")
        print(f"{'host share of a step':>22}: {us(period) - device_us:9.1f} us")


if __name__ == "__main__":
    main()
