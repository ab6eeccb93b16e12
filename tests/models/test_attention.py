"""The paged Attention layer stores K/V in its slots and equals plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncserve.kernels.ops import REFERENCE_OPS
from asyncserve.models.attention import Attention, AttentionMetadata


def test_attention_matches_causal_sdpa_and_fills_cache() -> None:
    heads, kv_heads, dim, block_size, tokens = 4, 2, 8, 4, 10
    torch.manual_seed(0)
    q = torch.randn(tokens, heads, dim)
    k = torch.randn(tokens, kv_heads, dim)
    v = torch.randn(tokens, kv_heads, dim)
    key_cache = torch.zeros(6, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    table = [5, 1, 3]  # non-contiguous blocks
    slots = [table[p // block_size] * block_size + p % block_size for p in range(tokens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        max_seqlen_q=tokens,
        max_seqlen_k=tokens,
    )
    attn = Attention(heads, kv_heads, dim, dim**-0.5, REFERENCE_OPS)
    out = attn(q, k, v, (key_cache, value_cache), meta)
    assert out.shape == (tokens, heads * dim)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(2, 0),
        v.transpose(0, 1).repeat_interleave(2, 0),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected.reshape(tokens, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(key_cache.view(-1, kv_heads, dim)[slots], k)
    torch.testing.assert_close(value_cache.view(-1, kv_heads, dim)[slots], v)


def test_attention_rejects_uneven_grouping() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(6, 4, 8, 0.35, REFERENCE_OPS)
