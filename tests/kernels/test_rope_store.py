"""rope_store_kv (Triton: per-head q/k norm, rotary and the KV store in one kernel) equals
reference.rope_store_kv (the three reference ops in turn)."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.rope_store import rope_store_kv  # noqa: E402
from asyncserve.kernels.split_k import sum_splits  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 6, 16


def _cos_sin_cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _case(
    device: torch.device,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    seed: int,
) -> dict[str, torch.Tensor]:
    """q, k, v as views of one fused projection output, caches, slots (two padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    width = num_heads + 2 * num_kv_heads
    qkv = (torch.randn((num_tokens, width, head_dim), generator=gen) * 3).to(dtype).to(device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    if num_tokens > 4:
        slots[[1, 4]] = -1
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return {
        "qkv": qkv,
        "positions": torch.randint(0, 256, (num_tokens,), generator=gen).to(device),
        "slots": slots.to(device),
        "key_cache": torch.randn(shape, generator=gen).to(cache_dtype).to(device),
        "value_cache": torch.randn(shape, generator=gen).to(cache_dtype).to(device),
        "q_norm": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device),
        "k_norm": (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device),
    }


def _run(
    fn: object, case: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int, **kw: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One op on copies of the case: (query, q/k/v rows afterwards, key cache, value cache)."""
    qkv = case["qkv"].clone()
    key_cache, value_cache = case["key_cache"].clone(), case["value_cache"].clone()
    q = qkv[:, :num_heads]
    k = qkv[:, num_heads : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]
    out = fn(  # type: ignore[operator]
        case["positions"],
        q,
        k,
        v,
        kw["cache"],
        kw["q_norm"],
        kw["k_norm"],
        1e-6,
        key_cache,
        value_cache,
        case["slots"],
        kw.get("k_scale", 1.0),
        kw.get("v_scale", 1.0),
    )
    return out, qkv, key_cache, value_cache


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "rotary_dim", "norm"),
    [
        (torch.float32, 64, 64, True),  # Qwen3's layer: norms, full rotary
        (torch.float32, 64, 64, False),  # Llama's: rotary and store only
        (torch.bfloat16, 64, 64, True),
        (torch.float32, 64, 32, True),  # partial rotary: dims past 32 normed, not rotated
        (torch.bfloat16, 64, 32, False),
        (torch.float32, 48, 48, True),  # half 24: not a power of 2
    ],
)
def test_rope_store_matches_reference(
    device: torch.device, dtype: torch.dtype, head_dim: int, rotary_dim: int, norm: bool
) -> None:
    num_heads, num_kv_heads = 4, 2
    case = _case(device, dtype, dtype, num_heads, num_kv_heads, head_dim, 11, head_dim + rotary_dim)
    kw = {
        "cache": _cos_sin_cache(256, rotary_dim).to(device),
        "q_norm": case["q_norm"] if norm else None,
        "k_norm": case["k_norm"] if norm else None,
    }
    ref_q, _, ref_kc, ref_vc = _run(reference.rope_store_kv, case, num_heads, num_kv_heads, **kw)
    out_q, qkv, key_cache, value_cache = _run(rope_store_kv, case, num_heads, num_kv_heads, **kw)
    assert out_q.data_ptr() == qkv.data_ptr()  # the query rotated in place
    _close(qkv[:, :num_heads], ref_q, dtype)
    _close(key_cache, ref_kc, dtype)
    assert torch.equal(value_cache, ref_vc)  # values are copied as they are
    # Padding rows store nothing: every slot the step did not name keeps its old bytes.
    named = case["slots"][case["slots"] >= 0].cpu()
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[named] = False
    flat = key_cache.view(-1, num_kv_heads, head_dim).cpu()
    before = case["key_cache"].view(-1, num_kv_heads, head_dim).cpu()
    assert torch.equal(flat[untouched], before[untouched])
    # The value rows of the projection output are untouched.
    assert torch.equal(
        qkv[:, num_heads + num_kv_heads :], case["qkv"][:, num_heads + num_kv_heads :]
    )


def test_rope_store_fp8_cache_and_one_token(device: torch.device) -> None:
    """An e4m3 cache stores value / scale; a single decode token (grid of one)."""
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    for num_tokens in (1, 9):
        case = _case(
            device, torch.float32, torch.float8_e4m3fn, num_heads, num_kv_heads, head_dim,
            num_tokens, num_tokens,
        )  # fmt: skip
        kw = {
            "cache": _cos_sin_cache(256, head_dim).to(device),
            "q_norm": case["q_norm"],
            "k_norm": case["k_norm"],
            "k_scale": 0.05,
            "v_scale": 0.02,
        }
        ref = _run(reference.rope_store_kv, case, num_heads, num_kv_heads, **kw)
        out = _run(rope_store_kv, case, num_heads, num_kv_heads, **kw)
        _close(out[0], ref[0], torch.float32)
        for ours, theirs in zip(out[2:], ref[2:], strict=True):
            got, want = ours.float(), theirs.float()
            # fp32 sums may differ in the last bit, which moves an e4m3 rounding by one unit
            # of its 3-bit mantissa; Triton's interpreter also drops the carry into the next
            # binade (test_fp8_kv.py).
            carry = (want.abs().log2() == want.abs().log2().round()) & (got == want / 2)
            near = (got - want).abs() <= want.abs() * 0.125
            assert (near | (carry & (device.type == "cpu"))).all()


def test_rope_store_rejects_bad_input(device: torch.device) -> None:
    case = _case(device, torch.float32, torch.float32, 4, 2, 32, 3, 0)
    cache = _cos_sin_cache(256, 32).to(device)
    q, k, v = case["qkv"][:, :4], case["qkv"][:, 4:6], case["qkv"][:, 6:]
    caches = (case["key_cache"], case["value_cache"], case["slots"])
    with pytest.raises(ValueError, match="come together"):
        rope_store_kv(case["positions"], q, k, v, cache, case["q_norm"], None, 1e-6, *caches)
    with pytest.raises(ValueError, match="norm weight"):
        rope_store_kv(
            case["positions"], q, k, v, cache, case["q_norm"].half(), case["k_norm"], 1e-6, *caches
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store_kv(
            case["positions"], q, k, v, cache, None, None, 1e-6, *caches[:2], caches[2][:2]
        )
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_store_kv(case["positions"], q, k, v, _cos_sin_cache(8, 40), None, None, 1e-6, *caches)


@pytest.mark.parametrize(
    ("dtype", "rotary_dim", "norm"),
    [(torch.bfloat16, 64, False), (torch.float32, 32, True), (torch.bfloat16, 32, False)],
)
def test_rope_store_from_split_sums(
    device: torch.device, dtype: torch.dtype, rotary_dim: int, norm: bool
) -> None:
    """q, k and v given as a split-K projection's fp32 partial sums: the same query, key
    cache and value cache as their sum (split order, rounded to dtype) given as it is; the
    query comes back in a tensor of its own (every dim written, those past rotary too)."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 64, 6
    case = _case(device, dtype, dtype, num_heads, num_kv_heads, head_dim, num_tokens, 7)
    gen = torch.Generator().manual_seed(rotary_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    parts = torch.randn((3, num_tokens, width), generator=gen).to(device)
    total = torch.empty((num_tokens, width), dtype=dtype, device=device)
    sum_splits(parts, total)  # the kernel the split sums replace
    case["qkv"] = total.view(num_tokens, -1, head_dim)
    kw = {
        "cache": _cos_sin_cache(256, rotary_dim).to(device),
        "q_norm": case["q_norm"] if norm else None,
        "k_norm": case["k_norm"] if norm else None,
    }
    want_q, _, want_kc, want_vc = _run(rope_store_kv, case, num_heads, num_kv_heads, **kw)
    key_cache, value_cache = case["key_cache"].clone(), case["value_cache"].clone()
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in parts.split(sizes, dim=-1))
    args = (kw["cache"], kw["q_norm"], kw["k_norm"], 1e-6, key_cache, value_cache, case["slots"])
    out_q = rope_store_kv(case["positions"], q, k, v, *args, dtype=dtype)
    assert out_q.shape == (num_tokens, num_heads, head_dim) and out_q.dtype == dtype
    if dtype == torch.float32 and norm and device.type == "cuda":
        # On an H200 (triton 3.6) the two builds of the kernel differ in fp32 by up to
        # 4.8e-7 on some heads' queries (213 of 1,536 values) when a norm meets dims past
        # rotary; keys equal. bf16 outputs, which the models use, round that away.
        torch.testing.assert_close(out_q, want_q, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out_q, want_q)
    assert torch.equal(key_cache, want_kc) and torch.equal(value_cache, want_vc)
    ref_q = reference.rope_store_kv(
        case["positions"], q, k, v, *args[:4], case["key_cache"].clone(),
        case["value_cache"].clone(), case["slots"], dtype=dtype,
    )  # fmt: skip
    _close(out_q, ref_q, dtype)


def test_rope_store_split_sums_need_a_dtype(device: torch.device) -> None:
    parts = torch.zeros((2, 1, 4, 8), device=device)
    cache = torch.zeros((1, 16, 2, 8), device=device)
    with pytest.raises(ValueError, match="dtype"):
        rope_store_kv(
            torch.zeros(1, dtype=torch.long, device=device), parts, parts[:, :, :2],
            parts[:, :, 2:], _cos_sin_cache(4, 8).to(device), None, None, 1e-6, cache, cache,
            torch.zeros(1, dtype=torch.long, device=device),
        )  # fmt: skip
