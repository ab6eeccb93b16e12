"""The rank side of tests/models/test_tp_families.py, in a module of its own so that the
spawned ranks import no more than they need (no transformers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import ModelConfig
from asyncserve.models.base import CausalLM
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from tests.models.conftest import BLOCK_SIZE, paged_step

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(21)]
SPLIT = 13  # first chunk: a prefill; second: the rest, reading the first from the cache


def load(path: str, tp: TensorParallel) -> CausalLM:
    return load_model(ModelConfig(model=path, dtype="float32"), torch.device("cpu"), tp).model


def logits(model: CausalLM, tp: TensorParallel) -> torch.Tensor:
    """PROMPT's logits, computed in two chunks through a paged cache of this rank's heads."""
    c = model.config
    num_kv = tp.kv_heads(c.num_key_value_heads)[1]
    blocks = (len(PROMPT) + BLOCK_SIZE - 1) // BLOCK_SIZE
    shape = (blocks, BLOCK_SIZE, num_kv, c.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_hidden_layers)]
    table = list(range(blocks))
    first = paged_step(model, caches, [(PROMPT[:SPLIT], 0, table)])[0]
    second = paged_step(model, caches, [(PROMPT, SPLIT, table)])[0]
    return torch.cat([first, second])


def rank_main(rank: int, init_method: str, jobs: list[tuple[str, str, bool]], queue: Any) -> None:
    """Each job (name, checkpoint, expert_parallel) on this rank; rank 0 reports the logits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        for name, path, expert_parallel in jobs:
            tp = TensorParallel(rank, 2, expert_parallel)
            out = logits(load(path, tp), tp)
            if rank == 0:
                queue.put((name, expert_parallel, out))
    finally:
        dist.destroy_process_group()
