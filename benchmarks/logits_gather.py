"""The LM head's collective per decode step under tensor parallelism: every rank receiving the
whole vocabulary's logits (all-gather, the way before) against only rank 0 receiving them
(gather to the driver, the way now; models/parallel.py). Each rank holds [batch, vocab / N]
fp32 logits; a call includes the concatenation into [batch, vocab].

Mean microseconds per call over `--iters` back-to-back calls, per rank (rank 0's is the one
that delays sampling), for each batch size; gloo on CPU, NCCL on CUDA (one GPU per rank).

    python benchmarks/logits_gather.py [--ranks 2] [--vocab 128256] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.models.parallel import TensorParallel  # noqa: E402


def _time(fn: Any, iters: int, cuda: bool) -> float:
    for _ in range(5):
        fn()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / iters


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)  # fmt: skip
    tp = TensorParallel(rank, size)
    results: dict[str, float] = {}
    for batch in args.batches:
        x = torch.randn(batch, args.vocab // size, device=device)
        for name, op in (("all_gather", tp.all_gather_last), ("gather", tp.gather_last_to_first)):
            results[f"{name}_b{batch}_us"] = _time(lambda op=op, x=x: op(x), args.iters, cuda)
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue))
             for r in range(args.ranks)]  # fmt: skip
    for p in procs:
        p.start()
    per_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    out: dict[str, Any] = {"ranks": args.ranks, "vocab": args.vocab, "per_rank": per_rank}
    for rank in sorted(per_rank):
        for key, value in per_rank[rank].items():
            print(f"rank {rank} {key}: {value:.1f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
