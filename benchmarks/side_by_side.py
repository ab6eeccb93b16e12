"""One workload, one engine, identical inputs: vLLM or asyncserve, for a side-by-side table.

Run each engine in its own process on the same device, one after the other:
  python side_by_side.py --engine vllm       --workloads w1b,w2 --model CONFIG_DIR
  python side_by_side.py --engine asyncserve --workloads w1b,w2 --model CONFIG_DIR
Prompts are random token ids from a fixed seed (the same for both), greedy, EOS ignored,
dummy weights, token ids only (detokenize=False for both: vLLM runs without a tokenizer),
the engines' own defaults otherwise (flags below override both the same way).
Prints one JSON line: engine, workload, elapsed, req/s, total tok/s, output tok/s, ms/token.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import random
import time

WORKLOADS = {
    # name: (num_prompts, in_lo, in_hi, out_lo, out_hi)
    "w1b": (1000, 256, 256, 256, 256),
    "w1": (1000, 1024, 1024, 128, 128),
    "w4": (256, 100, 1024, 100, 1024),
    "w2": (1, 128, 128, 256, 256),
    "tiny": (2, 16, 16, 8, 8),
}


def inputs(workload: str, vocab: int, seed: int = 0):
    n, ilo, ihi, olo, ohi = WORKLOADS[workload]
    rng = random.Random(seed)
    low = min(1000, vocab // 4)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(ilo, ihi))] for _ in range(n)]
    orng = random.Random(seed + 1)
    outs = [orng.randint(olo, ohi) for _ in range(n)]
    return prompts, outs


def common_kwargs(a):
    """The engine arguments both engines take by the same names: the shared ones and the
    flags given."""
    kw = dict(model=a.model, load_format="dummy", max_model_len=a.max_model_len, seed=0)
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.enforce_eager:
        kw["enforce_eager"] = True
    if a.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = a.tensor_parallel_size
    if a.disable_custom_all_reduce:
        kw["disable_custom_all_reduce"] = True
    if a.quantization:
        kw["quantization"] = a.quantization
    if a.max_cudagraph_capture_size:
        kw["max_cudagraph_capture_size"] = a.max_cudagraph_capture_size
    return kw


def build_vllm(a):
    from vllm import LLM

    return LLM(**common_kwargs(a), skip_tokenizer_init=True, dtype="bfloat16")


def gen_vllm(llm, prompts, outs):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False)
        for o in outs
    ]
    return [len(r.outputs[0].token_ids) for r in llm.generate(ps, sps, use_tqdm=False)]


def build_asyncserve(a):
    from asyncserve import LLM

    return LLM(**common_kwargs(a))


def gen_asyncserve(llm, prompts, outs):
    from asyncserve import SamplingParams

    sps = [
        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False)
        for o in outs
    ]
    return [len(r.outputs[0].token_ids) for r in llm.generate(prompts, sps, use_tqdm=False)]


@contextlib.contextmanager
def kernel_profile(path, workload):
    """With a path: the CUDA kernels run inside the block, summed per kernel name (kernels
    replayed from CUDA graphs included), written to path as a table with the block's wall time
    (each run's seconds appended to the yielded list) beside the kernels' total. vLLM's kernels are seen only with
    its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    wall = []
    if not path:
        yield wall
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise SystemExit("--kernel-summary needs a CUDA device")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield wall
    per_name = {}
    spans = []
    trace = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            trace.append((event.time_range.start, event.time_range.elapsed_us(), event.name))
            total, count = per_name.get(event.name, (0.0, 0))
            per_name[event.name] = (total + event.time_range.elapsed_us(), count + 1)
            spans.append((event.time_range.start, event.time_range.end))
    kernel_us = sum(total for total, _ in per_name.values())
    wall_us = 1e6 * sum(wall)
    rows = sorted(per_name.items(), key=lambda item: -item[1][0])
    with open(path, "a") as f:
        f.write(f"# {workload}: wall {wall_us / 1e3:.1f} ms, kernels {kernel_us / 1e3:.1f} ms "
                f"({100 * kernel_us / max(wall_us, 1):.0f}% of wall), {len(rows)} kernel names\n")  # fmt: skip
        f.write("ms\t% of kernels\tcalls\tus per call\tname\n")
        for name, (total, count) in rows[:40]:
            f.write(f"{total / 1e3:.1f}\t{100 * total / max(kernel_us, 1):.1f}\t{count}\t"
                    f"{total / count:.1f}\t{name[:150]}\n")  # fmt: skip
        f.write(device_timeline(spans))
    # Every kernel in start order, as nsys's cuda_gpu_trace CSV names its columns, for
    # benchmarks/step_trace.py (each kernel's share of a decode step).
    with open(path + ".trace.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Start (ns)", "Duration (ns)", "Name"])
        for start, elapsed, name in sorted(trace):
            writer.writerow([round(start * 1e3), round(elapsed * 1e3), name])


def device_timeline(spans, parts=10):
    """Where the device idled: the union of the kernels' intervals over the profiled span,
    cut into `parts` equal windows (busy % of each and kernels started in it), and the
    idle gaps between kernels by length."""
    if not spans:
        return "# no kernels\n"
    spans.sort()
    first, last = spans[0][0], max(end for _, end in spans)
    width = (last - first) / parts or 1.0
    busy = [0.0] * parts
    launches = [0] * parts
    gaps = {"<10us": [0, 0.0], "10-100us": [0, 0.0], "0.1-1ms": [0, 0.0], ">=1ms": [0, 0.0]}
    cur_start, cur_end = spans[0]
    merged = []
    for start, end in spans:
        launches[min(parts - 1, int((start - first) / width))] += 1
        if start > cur_end:
            merged.append((cur_start, cur_end))
            gap = start - cur_end
            key = (
                "<10us"
                if gap < 10
                else "10-100us"
                if gap < 100
                else "0.1-1ms"
                if gap < 1000
                else ">=1ms"
            )
            gaps[key][0] += 1
            gaps[key][1] += gap
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    merged.append((cur_start, cur_end))
    for start, end in merged:  # split each busy interval over the windows it covers
        while start < end:
            i = min(parts - 1, int((start - first) / width))
            stop = min(end, first + (i + 1) * width) if i < parts - 1 else end
            busy[i] += stop - start
            start = stop
    total_busy = sum(busy)
    lines = [f"# device timeline: span {(last - first) / 1e3:.1f} ms, busy {total_busy / 1e3:.1f} ms "
             f"({100 * total_busy / (last - first):.0f}%)"]  # fmt: skip
    lines.append("# window\tbusy %\tkernels")
    for i in range(parts):
        lines.append(f"# {i}\t{100 * busy[i] / width:.0f}\t{launches[i]}")
    lines.append(
        "# idle gaps: " + ", ".join(f"{k}: {n} ({t / 1e3:.1f} ms)" for k, (n, t) in gaps.items())
    )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def gc_pauses():
    """Python's garbage collections inside the block: count and milliseconds per generation
    (in this process: asyncserve's engine, or vLLM's engine core when it runs in-process)."""
    import gc

    stats = {gen: [0, 0.0] for gen in range(3)}
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            stats[info["generation"]][0] += 1
            stats[info["generation"]][1] += 1e3 * (time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    try:
        yield stats
    finally:
        gc.callbacks.remove(on_gc)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["vllm", "asyncserve"], required=True)
    p.add_argument("--workloads", required=True, help="comma-separated: " + ",".join(WORKLOADS))
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="NCCL only")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--kernel-summary",
        default=None,
        metavar="PATH",
        help="torch-profile the timed runs' CUDA kernels; write the time per kernel name here "
        "and each kernel's start and length to PATH.trace.csv",
    )
    p.add_argument(
        "--quantization", default=None, help="e.g. fp8: the same scheme for both engines"
    )
    a = p.parse_args()
    with open(os.path.join(a.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    build, gen = (
        (build_vllm, gen_vllm) if a.engine == "vllm" else (build_asyncserve, gen_asyncserve)
    )
    t0 = time.perf_counter()
    llm = build(a)
    startup = time.perf_counter() - t0
    for wl in a.workloads.split(","):
        prompts, outs = inputs(wl, vocab)
        gen(llm, prompts[:4], outs[:4])  # warm-up outside the timed region
        best = None
        with kernel_profile(a.kernel_summary, wl) as timing, gc_pauses() as collections:
            for _ in range(a.repeat):
                t = time.perf_counter()
                nout = sum(gen(llm, prompts, outs))
                el = time.perf_counter() - t
                best = el if best is None else min(best, el)
                timing.append(el)
        el = best
        nin = sum(map(len, prompts))
        rec = dict(
            engine=a.engine,
            workload=wl,
            model=os.path.basename(a.model.rstrip("/")),
            startup_s=round(startup, 1),
            elapsed_s=round(el, 3),
            req_s=round(len(prompts) / el, 2),
            total_tok_s=round((nin + nout) / el),
            out_tok_s=round(nout / el),
            ms_per_token=round(1000 * el / max(outs), 3) if len(prompts) == 1 else None,
            flags=dict(
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens,
                enforce_eager=a.enforce_eager,
                tensor_parallel_size=a.tensor_parallel_size,
                disable_custom_all_reduce=a.disable_custom_all_reduce,
                quantization=a.quantization,
            ),
        )
        print("RESULT " + json.dumps(rec), flush=True)
        pauses = {f"gen{g}": f"{n} in {ms:.1f} ms" for g, (n, ms) in collections.items()}
        print("GC " + json.dumps(pauses), flush=True)


if __name__ == "__main__":
    main()
