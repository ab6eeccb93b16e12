"""Device time of small kernels, as a decode step's CUDA graph replays them (launch overhead
out): used by the GEMV microbenchmarks (int4_gemv_bench.py, fp8_gemv_bench.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_ms(fns: list[Callable[[], object]], reps: int, calls: int = 20) -> float:
    """Median device time of one call: fns (each on its own weight copy, so the weights come
    from memory, not L2) called round-robin, `calls` calls captured in a CUDA graph, the graph
    replayed `reps` times between events."""
    sequence = [fns[i % len(fns)] for i in range(calls)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in sequence:  # warm-up (and compilation) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in sequence:
            fn()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
