"""The Triton kernels against their references at model sizes, on a CUDA device.

Includes a KV pool of more than 2**31 elements per cache (about 4.4 GB each for K and V)
with the used blocks at its end, so any int32 offset arithmetic would overflow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncserve.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import activation, attention, rope  # noqa: E402
from asyncserve.kernels.activation import silu_and_mul  # noqa: E402
from asyncserve.kernels.kv_store import store_kv  # noqa: E402
from asyncserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from asyncserve.kernels.rope import rotary_embedding  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_batch, rel_err  # noqa: E402

CUDA = torch.device("cuda")
ATTN_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _attention_err(batch: PagedBatch, scale: float) -> float:
    out = attention.unified_attention(
        *batch.args(), scale, max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k
    )
    ref = reference.unified_attention(*batch.args(), scale)
    assert torch.isfinite(out).all()
    return rel_err(out, ref)


def _mixed_lens(seed: int) -> tuple[list[int], list[int]]:
    """4 prefill chunks of 1-2k tokens with cached prefixes, then 60 decodes up to 8k."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1024, 2049, (4,), generator=gen).tolist()
    ctx = torch.randint(0, 3000, (4,), generator=gen).tolist()
    q_lens += [1] * 60
    ctx += torch.randint(1, 8192, (60,), generator=gen).tolist()
    return q_lens, ctx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_mixed_batch_model_size(dtype: torch.dtype) -> None:
    q_lens, ctx = _mixed_lens(seed=0)
    batch = make_batch(q_lens, ctx, 64, 8, 128, 16, dtype, CUDA, seed=1)
    assert _attention_err(batch, 128**-0.5) < ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_long_decodes_split_kv(dtype: torch.dtype) -> None:
    """Few long decodes take the split-KV path (llama3-8b heads)."""
    batch = make_batch([1, 1, 1], [16000, 5000, 300], 32, 8, 128, 16, dtype, CUDA, seed=2)
    config = attention.default_config(4, 1)
    num_sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    assert attention.choose_num_splits(3, 8, 1, 16001, config, num_sms) > 1
    assert _attention_err(batch, 128**-0.5) < ATTN_TOL[dtype]


def test_attention_and_store_kv_pool_over_2_31_elements() -> None:
    num_blocks = 2**31 // (16 * 8 * 128) + 2048  # 133120 blocks: 2.18e9 elements per cache
    q_lens = [300, 517, 1, 1, 1, 1, 1, 1]
    ctx = [200, 0, 2047, 1500, 900, 31, 1, 4000]
    batch = make_batch(
        q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, CUDA, num_blocks=num_blocks, blocks_at_end=True
    )
    assert batch.key_cache.numel() > 2**31
    # Every sequence's first block (and so all it reads) starts past element 2**31.
    assert int(batch.block_tables[:, 0].min()) * 16 * 8 * 128 > 2**31

    # store_kv: write this step's K/V over the slots of the last tokens of each sequence.
    seq_lens = batch.seq_lens.tolist()
    slots = []
    for b, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(n - q_len, n):
            slots.append(int(batch.block_tables[b, pos // 16]) * 16 + pos % 16)
    slot_mapping = torch.tensor(slots, device=CUDA)
    slot_mapping[5] = -1  # one padding token
    gen = torch.Generator(device=CUDA).manual_seed(3)
    key = torch.randn((len(slots), 8, 128), generator=gen, device=CUDA, dtype=torch.bfloat16)
    value = torch.randn((len(slots), 8, 128), generator=gen, device=CUDA, dtype=torch.bfloat16)
    kept_k = batch.key_cache.view(-1, 8, 128)[slots[5]].clone()
    store_kv(key, value, batch.key_cache, batch.value_cache, slot_mapping)
    valid = slot_mapping >= 0
    flat_k = batch.key_cache.view(-1, 8, 128)
    flat_v = batch.value_cache.view(-1, 8, 128)
    assert torch.equal(flat_k[slot_mapping[valid]], key[valid])
    assert torch.equal(flat_v[slot_mapping[valid]], value[valid])
    assert torch.equal(flat_k[slots[5]], kept_k)

    assert _attention_err(batch, 128**-0.5) < ATTN_TOL[torch.bfloat16]
    forced = attention.paged_attention(
        *batch.args(), 128**-0.5, attention.default_config(4, 1), num_splits=4
    )
    ref = reference.unified_attention(*batch.args(), 128**-0.5)
    assert rel_err(forced, ref) < ATTN_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_model_size(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(4)
    num_blocks, num_tokens = 4096, 2048
    key_cache = torch.randn((num_blocks, 16, 8, 128), generator=gen, device=CUDA, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    slot_mapping = torch.randperm(num_blocks * 16, device=CUDA)[:num_tokens]
    slot_mapping[::97] = -1
    key = torch.randn((num_tokens, 8, 128), generator=gen, device=CUDA, dtype=torch.float32)
    value = torch.randn_like(key)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, ref_k, ref_v, slot_mapping)
    store_kv(key, value, key_cache, value_cache, slot_mapping)  # casts fp32 -> dtype
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_model_size(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(5)
    x = torch.randn((2048, 4096), generator=gen, device=CUDA, dtype=dtype)
    residual = 4 * torch.randn((2048, 4096), generator=gen, device=CUDA, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(4096, generator=gen, device=CUDA, dtype=dtype)
    out = rms_norm(x, weight, 1e-5)
    ref = reference.rms_norm(x, weight, 1e-5)
    assert (out != ref).float().mean().item() < 0.01
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert (out != ref).float().mean().item() < 0.01
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_and_silu_model_size(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(6)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device=CUDA) / 128)
    freqs = torch.outer(torch.arange(8192, device=CUDA, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, 8192, (2048,), generator=gen, device=CUDA)
    query = torch.randn((2048, 64, 128), generator=gen, device=CUDA, dtype=dtype)
    key = torch.randn((2048, 8, 128), generator=gen, device=CUDA, dtype=dtype)
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    out_q, out_k = rotary_embedding(positions, query.clone(), key.clone(), cache)
    torch.testing.assert_close(out_q, ref_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out_k, ref_k, atol=1e-2, rtol=1e-2)
    assert (out_q != ref_q).float().mean().item() < 0.01

    x = 3 * torch.randn((2048, 2 * 14336), generator=gen, device=CUDA, dtype=dtype)
    out = silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert (out != ref).float().mean().item() < 0.01
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def _compiled_variants(kernel: Any) -> int:
    """Compiled specializations in a Triton kernel's per-device caches."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_attention_compiles_once_for_any_number_of_sequences() -> None:
    """Batches that differ only in their sequence count run one compiled kernel: Triton's
    integer specializations (== 1, divisible by 16) would otherwise compile mid-run."""
    variants = []
    for num_seqs in (1, 16, 17, 33):
        batch = make_batch([64] * num_seqs, [0] * num_seqs, 8, 2, 128, 16, torch.bfloat16, CUDA)
        assert _attention_err(batch, 128**-0.5) < ATTN_TOL[torch.bfloat16]
        variants.append(_compiled_variants(attention._unified_attention_kernel))
    assert variants[1:] == variants[:1] * 3, variants


def test_attention_compiles_once_for_any_block_table_width() -> None:
    """Decode batches whose block tables are 6, 16 and 17 blocks wide run one compiled kernel."""
    variants = []
    for context in (64, 239, 255):
        batch = make_batch([1] * 8, [context] * 8, 8, 2, 128, 16, torch.bfloat16, CUDA)
        assert batch.block_tables.shape[1] == {64: 6, 239: 16, 255: 17}[context]
        assert _attention_err(batch, 128**-0.5) < ATTN_TOL[torch.bfloat16]
        variants.append(_compiled_variants(attention._unified_attention_kernel))
    assert variants[1:] == variants[:1] * 2, variants


def test_rope_compiles_once_for_any_positions_offset() -> None:
    """Positions sliced at an odd offset (not 16-byte aligned) reuse the aligned compile."""
    cache = torch.randn((64, 64), device=CUDA)
    positions = torch.arange(9, device=CUDA)
    variants = []
    for start in (0, 1):
        query = torch.randn((8, 4, 64), device=CUDA, dtype=torch.bfloat16)
        key = torch.randn((8, 2, 64), device=CUDA, dtype=torch.bfloat16)
        pos = positions[start : start + 8]
        ref_q, ref_k = reference.rotary_embedding(pos, query, key, cache)
        out_q, out_k = rotary_embedding(pos, query.clone(), key.clone(), cache)
        torch.testing.assert_close(out_q, ref_q, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out_k, ref_k, atol=1e-2, rtol=1e-2)
        variants.append(_compiled_variants(rope._rotary_kernel))
    assert variants[1] == variants[0], variants


def test_a_compile_after_start_up_is_a_warning(caplog: Any) -> None:
    """Triton's real hooks: a kernel variant first met after start-up is logged by name."""
    import logging

    import triton

    from asyncserve.worker.kernel_compiles import CompileWatch

    knobs = triton.knobs.runtime
    saved = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    try:
        watch = CompileWatch()
        watch.arm()
        # The kernel's in-memory variants dropped: its next launch compiles (from Triton's
        # disk cache when another test compiled the same variant).
        activation._act_and_mul_kernel.device_caches.clear()
        x = torch.randn((3, 2 * 777), device=CUDA, dtype=torch.float16)
        with caplog.at_level(logging.WARNING, logger="asyncserve.worker.kernel_compiles"):
            silu_and_mul(x)
        assert watch.compiles_after_start == 1
        assert "_act_and_mul_kernel compiled after start-up" in caplog.text
        silu_and_mul(x)
        assert watch.compiles_after_start == 1
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = saved


def test_grammar_mask_compiles_only_at_warm_up() -> None:
    """The start-up warm-up compiles every variant the grammar mask can need: a model's own
    vocabulary (any size) and row counts compile nothing more."""
    from asyncserve.kernels import bitmask as bitmask_kernels
    from asyncserve.worker.grammar_mask import apply_token_bitmask_, warm_up_grammar_kernel

    warm_up_grammar_kernel(CUDA)
    before = _compiled_variants(bitmask_kernels._apply_bitmask_kernel)
    for vocab in (32003, 49152):
        logits = torch.randn((5, vocab), device=CUDA)
        words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
        apply_token_bitmask_(logits, words, [4, 0, 2])
        apply_token_bitmask_(logits[:3], words, None)
    assert _compiled_variants(bitmask_kernels._apply_bitmask_kernel) == before
