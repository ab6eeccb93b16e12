"""All-reduce latency between tensor-parallel ranks, at the sizes one decode step reduces
(tokens x hidden, bf16 on CUDA): what TP=2 pays per layer twice over. A batch-1 decode of
Llama-3-8B does 64 of them per token (two per layer), so at 15 us each NCCL would add about
1 ms to a token that the halved weight reads bring from ~3.4 ms down to ~1.7 ms.

Eager: the mean of `--iters` back-to-back all-reduces, timed with CUDA events. Graph: the
same all-reduces captured in one CUDA graph and replayed (how decode steps run).

    python benchmarks/allreduce_latency.py [--ranks 2] [--hidden 4096] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from multiprocessing import get_context
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncserve.worker import fast_all_reduce  # noqa: E402


def _time_fast(fast: Any, x: torch.Tensor, iters: int) -> dict[str, float]:
    """The one-shot path, eager and in a graph, checked against NCCL's sum first."""
    expected = x.clone()
    dist.all_reduce(expected)
    row: dict[str, float] = {"fast_equal_nccl": float(torch.equal(fast(x), expected))}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fast(x)
    end.record()
    end.synchronize()
    row["fast_eager_us"] = start.elapsed_time(end) * 1e3 / iters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(64):
            fast(x)
    graph.replay()
    torch.cuda.synchronize()
    reps = max(1, iters // 64)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    row["fast_graph_us"] = start.elapsed_time(end) * 1e3 / (reps * 64)
    return row


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size,
    )  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    results: dict[str, Any] = {}
    # The one-shot kernel over symmetric memory that TP ranks use for small all-reduces.
    fast = fast_all_reduce.build(rank, size, device, dtype) if cuda else None
    results["symmetric_memory"] = fast is not None
    for tokens in (1, 8, 64, 256, 512):
        x = torch.ones(tokens, args.hidden, dtype=dtype, device=device)
        for _ in range(20):
            dist.all_reduce(x)
        row: dict[str, float] = {}
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                dist.all_reduce(x)
            end.record()
            end.synchronize()
            row["eager_us"] = start.elapsed_time(end) * 1e3 / args.iters
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(64):
                    dist.all_reduce(x)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            reps = max(1, args.iters // 64)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            row["graph_us"] = start.elapsed_time(end) * 1e3 / (reps * 64)
            if fast is not None and fast(x) is not None:
                row.update(_time_fast(fast, x, args.iters))
        else:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(x)
            row["eager_us"] = (time.perf_counter() - t0) * 1e6 / args.iters
        results[f"{tokens}x{args.hidden}"] = {k: round(v, 2) for k, v in row.items()}
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    report = {"ranks": args.ranks, "cuda": torch.cuda.is_available(), "all_reduce": results}
    print(json.dumps(report, indent=2))
    out = args.output_json or (
        os.path.join(os.environ["OUT"], "allreduce_latency.json") if os.environ.get("OUT") else None
    )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
