"""Fixtures for model tests: the SmolLM2 GGUF loaded by our loader, and a paged forward helper."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.gguf_loader import GGUFFile, open_gguf
from asyncserve.models.loader import LoadedModel, load_model

BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def smollm2_gguf(gguf_path: Path) -> GGUFFile:
    return open_gguf(gguf_path)


@pytest.fixture(scope="session")
def smollm2(gguf_path: Path) -> LoadedModel:
    return load_model(ModelConfig(model=str(gguf_path), dtype="float32"), torch.device("cpu"))


def new_kv_caches(
    model: CausalLM, num_blocks: int, block_size: int = BLOCK_SIZE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    param = next(model.parameters())
    return [
        (
            torch.zeros(shape, dtype=param.dtype, device=param.device),
            torch.zeros(shape, dtype=param.dtype, device=param.device),
        )
        for _ in range(c.num_hidden_layers)
    ]


@torch.no_grad()
def paged_step(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    seqs: Sequence[tuple[list[int], int, list[int]]],
) -> list[torch.Tensor]:
    """One step over a batch. Each entry is (token ids so far, tokens already in the cache,
    block table); computes ids[cached:] and returns each sequence's logits for those rows."""
    block_size = kv_caches[0][0].shape[1]
    device = kv_caches[0][0].device  # the model's: a CUDA model takes CUDA inputs
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    for tokens, cached, table in seqs:
        for p in range(cached, len(tokens)):
            ids.append(tokens[p])
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(len(ids))
    width = max(len(t) for _, _, t in seqs)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([len(t) for t, _, _ in seqs], dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for _, _, t in seqs], dtype=torch.int32, device=device
        ),
        max_seqlen_q=max(cu[i + 1] - cu[i] for i in range(len(seqs))),
        max_seqlen_k=max(len(t) for t, _, _ in seqs),
    )
    hidden = model(
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        kv_caches,
        meta,
    )
    logits = model.compute_logits(hidden)
    return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]


def full_forward(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence, from one prefill into a fresh cache."""
    num_blocks = (len(ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    caches = new_kv_caches(model, num_blocks)
    return paged_step(model, caches, [(ids, 0, list(range(num_blocks)))])[0]
