"""unified_attention (Triton) equals reference.unified_attention on mixed batches."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

triton = pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import attention  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_batch, rel_err  # noqa: E402

# 2 prefill chunks with cached prefixes (one a fresh prompt) and 3 decodes.
Q_LENS = [19, 7, 1, 1, 1]
CTX_LENS = [21, 0, 40, 16, 3]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _check(batch: PagedBatch, out: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    ref = reference.unified_attention(*batch.args(), scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    # GQA 4:1, MHA 1:1, a group of 3 (not a power of 2), Gemma 3's head dim (its own tiles)
    [(8, 2, 64), (2, 2, 32), (6, 2, 32), (4, 2, 256)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_batch(
        Q_LENS, CTX_LENS, num_heads, num_kv_heads, head_dim, 16, dtype, device, seed=head_dim
    )
    scale = head_dim**-0.5
    out = attention.unified_attention(
        *batch.args(), scale, max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k
    )
    _check(batch, out, dtype, scale)


def test_split_kv_mixed_batch(device: torch.device) -> None:
    """The split-KV path, forced, on a batch holding prefill chunks as well as decodes.

    With 16-key tiles and 4 splits some splits of the short sequences get no tile at all.
    """
    batch = make_batch(Q_LENS, CTX_LENS, 4, 2, 32, 16, torch.float32, device, seed=4)
    config = attention.AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out = attention.paged_attention(*batch.args(), 0.125, config, 4)
    _check(batch, out, torch.float32, 0.125)


def test_split_kv_decode_heuristic(device: torch.device) -> None:
    """Few long decodes pick split-KV by themselves; the result still matches."""
    batch = make_batch([1, 1], [700, 170], 4, 1, 32, 16, torch.bfloat16, device, seed=7)
    config = attention.default_config(4, batch.max_seqlen_q)
    splits = attention.choose_num_splits(2, 1, 1, batch.max_seqlen_k, config, 132)
    assert splits > 1
    out = attention.unified_attention(
        *batch.args(), 32**-0.5, max_seqlen_q=1, max_seqlen_k=batch.max_seqlen_k
    )
    _check(batch, out, torch.bfloat16, 32**-0.5)


def test_tiles_span_blocks_and_no_hints(device: torch.device) -> None:
    """Key tiles larger than a cache block (block_size 8), hints left out, fp16."""
    batch = make_batch([5, 1, 12], [11, 30, 0], 4, 2, 32, 8, torch.float16, device, seed=3)
    out = attention.unified_attention(*batch.args(), 0.2)
    _check(batch, out, torch.float16, 0.2)


def test_empty_sequence_and_strided_query(device: torch.device) -> None:
    """A sequence with no query tokens this step, and a query sliced out of a fused qkv."""
    batch = make_batch([3, 0, 1], [4, 9, 20], 4, 2, 32, 16, torch.float32, device, seed=5)
    qkv = torch.randn((batch.query.shape[0], 8, 32), device=device)
    qkv[:, :4] = batch.query
    batch.query = qkv[:, :4]
    assert not batch.query.is_contiguous()
    out = attention.unified_attention(*batch.args(), 0.3, max_seqlen_q=3, max_seqlen_k=20)
    _check(batch, out, torch.float32, 0.3)


def test_head_dim_256_tiles() -> None:
    """Head dim 256 gets its own H100-swept tiles where shared memory allows them."""
    decode, prefill = attention.default_config(2, 1, 256), attention.default_config(2, 512, 256)
    assert (decode.block_m, decode.num_stages) == (16, 3)
    assert (prefill.block_m, prefill.num_warps, prefill.num_stages) == (128, 8, 3)
    small = attention.default_config(2, 512, 256, large_smem=False)
    assert small == attention.default_config(2, 512)


def test_split_heuristic() -> None:
    config = attention.default_config(4, 1)
    # Many decodes fill the chip: no split.
    assert attention.choose_num_splits(64, 8, 1, 2048, config, 132) == 1
    # One long decode: split, a power of two, capped.
    splits = attention.choose_num_splits(1, 8, 1, 32768, config, 132)
    assert splits == 32
    # Short contexts are not worth splitting.
    assert attention.choose_num_splits(1, 8, 1, 200, config, 132) == 1
    # Prefill chunks in the batch: no split.
    prefill = attention.default_config(4, 512)
    assert attention.choose_num_splits(1, 8, 512, 32768, prefill, 132) == 1


def test_split_heuristic_between_one_and_two_programs_an_sm() -> None:
    config = attention.default_config(2, 1)
    assert attention.choose_num_splits(17, 8, 1, 2048, config, 132) == 8
    assert attention.choose_num_splits(32, 8, 1, 2048, config, 132) == 8
    # Short contexts cap the splits at four 64-key tiles each.
    assert attention.choose_num_splits(17, 8, 1, 1024, config, 132) == 4
    assert attention.choose_num_splits(33, 8, 1, 2048, config, 132) == 1
    assert attention.choose_num_splits(16, 8, 1, 2048, config, 132) == 4  # 2 x SMs / 128


def test_128_key_tiles(device: torch.device) -> None:
    """A decode batch launched with 128-key tiles equals the reference (contexts not a
    multiple of 128, one shorter than a tile)."""
    batch = make_batch([1] * 5, [300, 1, 129, 127, 256], 4, 2, 32, 8, torch.float32, device, seed=3)
    config = attention.AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=2)
    out = attention.paged_attention(*batch.args(), 0.3, config, 1)
    assert rel_err(out, reference.unified_attention(*batch.args(), 0.3)) < TOL[torch.float32]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads_first", [False, True])
def test_decodes_longest_first_give_the_same_bits(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, splits: int, heads_first: bool
) -> None:
    """A decode batch's programs in seq_order (longest first), with the grid over KV heads
    first or over q-blocks first, compute what the listed order computes, bit for bit."""
    ctx = [30, 70, 5, 52, 17, 70]
    batch = make_batch([1] * 6, ctx, 4, 2, 32, 16, torch.float32, device, seed=11)
    config = attention.AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    monkeypatch.setattr(attention, "HEADS_FIRST", heads_first)
    listed = attention.paged_attention(*batch.args(), 0.125, config, splits)
    order = torch.argsort(batch.seq_lens, descending=True, stable=True).to(torch.int32)
    assert order.tolist() == [1, 5, 3, 0, 4, 2]
    ordered = attention.paged_attention(*batch.args(), 0.125, config, splits, seq_order=order)
    torch.testing.assert_close(ordered, listed, rtol=0, atol=0)
    _check(batch, ordered, torch.float32, 0.125)


def test_an_order_is_kept_for_launches_of_several_waves_of_one_q_block_sequences() -> None:
    config = attention.default_config(2, 19, 32)  # 64 rows: 32 tokens of 2 heads a program
    assert attention.keeps_seq_order(config, 2, 19, programs=528, num_sms=132)
    assert attention.keeps_seq_order(config, 2, 32, programs=2048, num_sms=132)
    assert not attention.keeps_seq_order(config, 2, 33, programs=2048, num_sms=132)
    assert not attention.keeps_seq_order(config, 2, 1, programs=512, num_sms=132)


def test_an_order_serves_sequences_of_one_q_block_and_is_dropped_for_longer_ones(
    device: torch.device,
) -> None:
    """With every sequence's query tokens in one q-block (here up to 19 of 32) the ordered
    programs compute the listed ones' bits; unified_attention drops seq_order where
    keeps_seq_order says so (here a longer chunk, whose q-blocks are found from
    cu_seqlens_q); paged_attention checks the order's length."""
    config = attention.default_config(2, 19, 32)
    batch = make_batch(Q_LENS, CTX_LENS, 4, 2, 32, 16, torch.float32, device, seed=12)
    order = torch.argsort(batch.seq_lens, descending=True).to(torch.int32)
    listed = attention.paged_attention(*batch.args(), 0.125, config, 1)
    ordered = attention.paged_attention(*batch.args(), 0.125, config, 1, seq_order=order)
    torch.testing.assert_close(ordered, listed, rtol=0, atol=0)
    _check(batch, ordered, torch.float32, 0.125)
    with pytest.raises(ValueError, match="seq_order"):
        attention.paged_attention(*batch.args(), 0.125, config, 1, seq_order=order[:2])

    long_batch = make_batch([40, 1, 1], [10, 30, 5], 4, 2, 32, 16, torch.float32, device, seed=13)
    out = attention.unified_attention(
        *long_batch.args(), 0.125, max_seqlen_q=40, max_seqlen_k=long_batch.max_seqlen_k,
        seq_order=torch.tensor([1, 0, 2], dtype=torch.int32, device=device),
    )  # fmt: skip
    _check(long_batch, out, torch.float32, 0.125)


@pytest.mark.parametrize(
    ("window", "softcap", "num_splits"),
    [(5, None, 1), (16, None, 4), (None, 3.0, 1), (7, 2.0, 2)],
)
def test_sliding_window_and_softcap(
    device: torch.device, window: int | None, softcap: float | None, num_splits: int
) -> None:
    """Windows shorter than the chunks and contexts (some tiles skipped, split-KV partly
    empty), and soft-capped scores large enough for the cap to bind."""
    batch = make_batch(Q_LENS, CTX_LENS, 4, 2, 32, 8, torch.float32, device, seed=11)
    batch.query = batch.query * 4
    config = attention.AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out = attention.paged_attention(
        *batch.args(), 0.25, config, num_splits, sliding_window=window, softcap=softcap
    )
    ref = reference.unified_attention(*batch.args(), 0.25, sliding_window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float32]
    plain = reference.unified_attention(*batch.args(), 0.25)
    assert rel_err(plain, ref) > 1e-2  # the options change the result


def test_reference_window_equals_truncated_context(device: torch.device) -> None:
    """A windowed decode equals full attention over only the last `window` keys."""
    batch = make_batch([1], [30], 4, 2, 32, 8, torch.float32, device, seed=2)
    windowed = reference.unified_attention(*batch.args(), 0.2, sliding_window=6)
    k = batch.key_cache[batch.block_tables[0, :4].long()].reshape(-1, 2, 32)[25:31]
    v = batch.value_cache[batch.block_tables[0, :4].long()].reshape(-1, 2, 32)[25:31]
    scores = torch.einsum("hd,khd->hk", batch.query[0], k.repeat_interleave(2, dim=1)) * 0.2
    expected = torch.einsum("hk,khd->hd", scores.softmax(-1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(windowed[0], expected, atol=1e-5, rtol=0)
