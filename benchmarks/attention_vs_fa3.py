"""asyncserve's paged attention kernel against vLLM's FlashAttention 3 on the same batches.

The same paged K/V pool ([blocks, 16, KV heads, head dim], bf16), block tables, queries
and sequence lengths go to `attention.unified_attention` and to vLLM 0.26.0's
`vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)` (the kernel its W1b and
W4 runs use on Hopper). Batches shaped like the offline workloads' steps:
  w4-decode    Qwen3-0.6B heads (16 / 8 / 128), 256 decodes, contexts 100-2,048 (W4 mid-run)
  w4-tail      the same heads, 24 decodes, contexts 1,000-2,048 (W4's last steps)
  w1b-decode   Llama-3-8B heads (32 / 8 / 128), 512 decodes, contexts 257-512
  equal-2k     Llama-3-8B heads, 64 decodes of 2,048 (bench_kernels.py's shape)
  w4-prefill   Qwen3-0.6B heads, 16,384 new tokens of prompts 100-1,024 (a W4 prefill step)
Each kernel is timed as CUDA-graph replays (median of triton's do_bench_cudagraph); decodes
are reported as K/V bandwidth, prefills as TFLOP/s; the outputs are compared.

    PYTHONPATH=/tmp/site_v:$PYTHONPATH python benchmarks/attention_vs_fa3.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.testing import do_bench_cudagraph  # noqa: E402

from asyncserve.kernels import attention  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_batch, rel_err  # noqa: E402

QWEN, LLAMA = (16, 8, 128), (32, 8, 128)
BLOCK = 16


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def prompts_to(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Prompt lengths in [lo, hi] adding up to total (the last one cut to fit)."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def batches() -> dict[str, tuple[tuple[int, int, int], list[int], list[int]]]:
    """name -> (heads, new tokens per sequence, cached tokens per sequence)."""
    w4 = lengths(256, 100, 2048, 0)
    tail = lengths(24, 1000, 2048, 1)
    w1b = lengths(512, 257, 512, 2)
    prefill = prompts_to(16384, 100, 1024, 3)
    return {
        "w4-decode": (QWEN, [1] * len(w4), [c - 1 for c in w4]),
        "w4-tail": (QWEN, [1] * len(tail), [c - 1 for c in tail]),
        "w1b-decode": (LLAMA, [1] * len(w1b), [c - 1 for c in w1b]),
        "equal-2k": (LLAMA, [1] * 64, [2047] * 64),
        "w4-prefill": (QWEN, prefill, [0] * len(prefill)),
    }


def graph_ms(fn) -> float:  # type: ignore[no-untyped-def]
    return min(float(do_bench_cudagraph(fn, rep=100, return_mode="median")) for _ in range(2))


def measure(name: str, heads: tuple[int, int, int], q_lens: list[int], ctx: list[int]) -> None:
    num_heads, num_kv_heads, head_dim = heads
    device = torch.device("cuda")
    batch: PagedBatch = make_batch(
        q_lens, ctx, num_heads, num_kv_heads, head_dim, BLOCK, torch.bfloat16, device
    )
    scale = head_dim**-0.5
    max_q, max_k = batch.max_seqlen_q, batch.max_seqlen_k

    def ours() -> torch.Tensor:
        return attention.unified_attention(
            *batch.args(), scale, max_seqlen_q=max_q, max_seqlen_k=max_k
        )

    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def fa3() -> torch.Tensor:
        return flash_attn_varlen_func(
            batch.query, batch.key_cache, batch.value_cache, max_q, batch.cu_seqlens_q, max_k,
            seqused_k=batch.seq_lens, softmax_scale=scale, causal=True,
            block_table=batch.block_tables, fa_version=3,
        )  # fmt: skip

    seq_lens = [q + c for q, c in zip(q_lens, ctx, strict=True)]
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * 2
    flops = 4.0 * sum(q * (c + (q + 1) / 2) for q, c in zip(q_lens, ctx, strict=True))
    flops *= num_heads * head_dim
    decode = max_q == 1
    print(
        f"\n{name}: {len(q_lens)} sequences, {sum(q_lens)} new tokens, K/V {kv_bytes / 1e6:.0f} MB"
    )
    results = {}
    for label, fn in (("asyncserve", ours), ("vLLM FA3", fa3)):
        try:
            ms = graph_ms(fn)
        except Exception as exc:  # one kernel failing still reports the other
            print(f"  {label:10s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        results[label] = (ms, fn())
        rate = f"{kv_bytes / ms / 1e6:7.0f} GB/s" if decode else f"{flops / ms / 1e9:6.1f} TFLOP/s"
        print(f"  {label:10s} {ms * 1e3:9.1f} us  {rate}")
    if len(results) == 2:
        (ms_ours, out_ours), (ms_fa3, out_fa3) = results["asyncserve"], results["vLLM FA3"]
        print(f"  asyncserve / FA3 time {ms_ours / ms_fa3:.2f}x; outputs differ by "
              f"{rel_err(out_ours, out_fa3.view_as(out_ours)):.1e} (relative)")  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device and vLLM 0.26.0 (its FlashAttention 3)")
    print(torch.cuda.get_device_name())
    for name, (heads, q_lens, ctx) in batches().items():
        measure(name, heads, q_lens, ctx)


if __name__ == "__main__":
    main()
