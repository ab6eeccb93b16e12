"""rope_store_kv (Triton: per-head q/k norm, rotary and the KV store in one kernel) equals
reference.rope_store_kv (the three reference ops in turn)."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.rope_store import rope_store_kv  # noqa: E402

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
