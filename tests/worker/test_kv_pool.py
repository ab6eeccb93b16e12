"""worker/kv_pool.py's profile step: the largest step as prompts no longer than the model's
length (a step's budget may exceed it), each in blocks of its own."""

from __future__ import annotations

import torch

from asyncserve.kernels import reference
from asyncserve.worker.kv_pool import profile_batch


def test_profile_batch_splits_the_budget_into_prompts_of_the_model_length() -> None:
    meta, positions = profile_batch(16384 + 100, 2048, 16)
    assert meta.seq_lens.tolist() == [2048] * 8 + [100]
    assert meta.cu_seqlens_q.tolist()[-1] == 16484 and meta.max_seqlen_q == 2048
    assert meta.block_tables.shape == (9, 128)
    # Every token its own slot, in its own sequence's blocks.
    assert meta.slot_mapping.unique().numel() == 16484
    bounds = meta.cu_seqlens_q.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        blocks = meta.slot_mapping[start:end] // 16
        assert set(blocks.tolist()) <= set(meta.block_tables[i].tolist())
        assert positions[start:end].tolist() == list(range(end - start))


def test_profile_batch_within_the_model_length_is_one_prompt() -> None:
    meta, positions = profile_batch(2048, 4096, 16)
    assert meta.seq_lens.tolist() == [2048] and meta.block_tables.shape == (1, 128)
    assert torch.equal(meta.slot_mapping, torch.arange(2048))
    assert torch.equal(positions, torch.arange(2048))


def test_profile_batch_runs_through_attention() -> None:
    """The batch is a valid step: the reference attention takes it (10 tokens, length 4)."""
    meta, _ = profile_batch(10, 4, 2)
    heads, dim = 2, 8
    q = torch.randn(10, heads, dim)
    k_cache = torch.zeros(meta.block_tables.numel(), 2, heads, dim)
    out = reference.unified_attention(
        q, k_cache, k_cache.clone(), meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.5
    )
    assert out.shape == (10, heads, dim)
