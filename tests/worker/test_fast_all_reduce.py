"""The one-shot symmetric-memory all-reduce: equal to NCCL's sum, eager and in a CUDA graph,
on two GPUs; off (NCCL/gloo only) where it cannot run."""

from __future__ import annotations

import socket
from multiprocessing import get_context
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncserve.models.parallel import TensorParallel
from asyncserve.worker import fast_all_reduce


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _gloo_rank(rank: int, port: int, queue: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    made = fast_all_reduce.build(rank, 2, torch.device("cpu"), torch.float32)
    tp = TensorParallel(rank, 2)
    x = torch.full((3, 8), float(rank + 1))
    queue.put((rank, made is None, tp.all_reduce(x).tolist()))
    dist.destroy_process_group()


def test_cpu_ranks_keep_the_plain_all_reduce() -> None:
    ctx = get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    for _, none, summed in results:
        assert none
        assert summed == [[3.0] * 8] * 3


def _cuda_rank(rank: int, port: int, queue: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TensorParallel(rank, 2)
    tp.fast.reduce = fast_all_reduce.build(rank, 2, device, torch.bfloat16)
    report: dict[str, Any] = {"on": tp.fast.reduce is not None}
    gen = torch.Generator(device=device).manual_seed(rank)
    for tokens in (1, 3, 256, 600):  # 600 x 4096 bf16 is over the 4 MiB limit: NCCL
        x = torch.randint(-8, 8, (tokens, 4096), generator=gen, device=device).bfloat16()
        expected = x.clone()
        dist.all_reduce(expected)
        report[f"eager_{tokens}"] = torch.equal(tp.all_reduce(x.clone()), expected)
    odd = torch.ones(3, 5, dtype=torch.bfloat16, device=device)  # 30 bytes: not 16-aligned
    report["odd"] = tp.all_reduce(odd.clone()).tolist() == [[2.0] * 5] * 3
    x = torch.randint(-8, 8, (8, 4096), generator=gen, device=device).bfloat16()
    expected = x.clone()
    dist.all_reduce(expected)
    static = x.clone()
    tp.all_reduce(static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    report["graph"] = torch.equal(out, expected)
    queue.put((rank, report))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_equals_nccl_on_two_gpus() -> None:
    ctx = get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_cuda_rank, args=(r, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(60)
    for rank, report in results.items():
        assert all(report.values()), (rank, report)
