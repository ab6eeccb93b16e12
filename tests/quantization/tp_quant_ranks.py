"""The rank side of tests/quantization/test_quant_tensor_parallel.py (a module of its own so
that the spawned ranks import no more than they need)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import ModelConfig
from asyncserve.models.base import CausalLM
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from tests.models.tp_ranks import logits


def load(path: str, tp: TensorParallel, quantization: str | None) -> CausalLM:
    config = ModelConfig(model=path, dtype="float32", quantization=quantization)
    return load_model(config, torch.device("cpu"), tp).model


def rank_main(rank: int, init_method: str, jobs: list[tuple[Any, ...]], queue: Any) -> None:
    """Each job (name, checkpoint, quantization[, expert_parallel]) on this rank; rank 0
    reports the logits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        for name, path, quantization, *expert_parallel in jobs:
            tp = TensorParallel(
                rank, 2, expert_parallel=bool(expert_parallel and expert_parallel[0])
            )
            out = logits(load(path, tp, quantization), tp)
            if rank == 0:
                queue.put((name, out))
    finally:
        dist.destroy_process_group()
