"""Microbenchmark of the Triton unified attention kernel on a CUDA device.

Decode batches (llama3-8b heads: 32 query, 8 KV, head dim 128, bf16, block size 16) are
timed against torch SDPA over the same K/V laid out contiguously, and reported as achieved
bandwidth: bytes of K/V the kernel must read over its median time. Times are of CUDA graph
replays (launch overhead excluded, as in the runner's decode steps); "eager" adds it back. A mixed prefill+decode
batch is reported in TFLOP/s. --sweep also times other tile shapes and split-KV factors.

    python benchmarks/bench_kernels.py [--sweep] [--shape gemma3-4b] [--decode 256x1024,24x1536]

--shape picks another model's attention heads (Gemma 3 4B: 8 query, 4 KV, head dim 256,
where a 64-row prefill tile holds twice the registers of Llama's).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from asyncserve.kernels import attention, reference  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_batch, rel_err  # noqa: E402

# (query heads, KV heads, head dim) of the shapes --shape offers.
SHAPES = {"llama3-8b": (32, 8, 128), "gemma3-4b": (8, 4, 256), "qwen3-0.6b": (16, 8, 128)}
HEADS, KV_HEADS, HEAD_DIM = SHAPES["llama3-8b"]
BLOCK = 16
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16
CUDA = torch.device("cuda")


def _ms(fn: Callable[[], object]) -> float:
    """Median device time in ms of fn replayed as a CUDA graph (as the runner replays decode
    steps), so Python launch overhead stays out; the lower of two runs."""
    return min(float(do_bench_cudagraph(fn, rep=100, return_mode="median")) for _ in range(2))


def _eager_ms(fn: Callable[[], object]) -> float:
    """Median time in ms of plain launches, Python launch overhead included."""
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def kv_bytes(batch: PagedBatch) -> int:
    """K and V of every context token, read once."""
    tokens = int(batch.seq_lens.sum())
    return 2 * tokens * KV_HEADS * HEAD_DIM * batch.key_cache.element_size()


def attn_flops(q_lens: list[int], ctx: list[int]) -> float:
    """QK^T and PV multiply-adds of causal attention over cached prefix + new tokens."""
    keys = sum(q * (c + (q + 1) / 2) for q, c in zip(q_lens, ctx, strict=True))
    return 4.0 * keys * HEADS * HEAD_DIM


def sdpa_decode_ms(batch: PagedBatch) -> tuple[float, float]:
    """SDPA on contiguous K/V of the same contexts (all equal): GQA native, and expanded."""
    num_seqs = batch.seq_lens.shape[0]
    ctx = int(batch.seq_lens[0])
    q = batch.query.view(num_seqs, HEADS, 1, HEAD_DIM)
    blocks = batch.block_tables[:, : (ctx + BLOCK - 1) // BLOCK].long()
    k = batch.key_cache[blocks].reshape(num_seqs, -1, KV_HEADS, HEAD_DIM)[:, :ctx]
    v = batch.value_cache[blocks].reshape(num_seqs, -1, KV_HEADS, HEAD_DIM)[:, :ctx]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    gqa = _ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True))
    k_full = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v_full = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    full = _ms(lambda: F.scaled_dot_product_attention(q, k_full, v_full, scale=SCALE))
    return gqa, full


def run_variant(
    batch: PagedBatch, ref: torch.Tensor, config: attention.AttentionConfig, splits: int
) -> tuple[float, float]:
    def call() -> torch.Tensor:
        return attention.paged_attention(*batch.args(), SCALE, config, splits)

    return _ms(call), rel_err(call(), ref)


def decode_batch(lens: list[int]) -> tuple[PagedBatch, torch.Tensor, int]:
    """A decode batch of these contexts (one new token each), its reference output and the
    bytes of K/V it reads."""
    batch = make_batch(
        [1] * len(lens), [n - 1 for n in lens], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE, CUDA,
        seed=len(lens),
    )  # fmt: skip
    return batch, reference.unified_attention(*batch.args(), SCALE), kv_bytes(batch)


def bench_decode(
    num_seqs: int,
    ctx: int,
    sweep_configs: bool,
    sweep_splits: bool,
    best: list[tuple],
    ragged: bool = False,
) -> None:
    """Time one decode batch; best holds the fastest (tile, warps, stages) found so far.
    ragged: contexts uniform in [ctx / 2, 3 ctx / 2] (mean ctx) instead of all equal."""
    lens = [ctx] * num_seqs
    if ragged:
        gen = torch.Generator().manual_seed(num_seqs)
        lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (num_seqs,), generator=gen).tolist()
    batch, ref, nbytes = decode_batch(lens)
    num_sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    config = attention.default_config(HEADS // KV_HEADS, 1, HEAD_DIM)
    max_len = max(lens)
    splits = attention.choose_num_splits(num_seqs, KV_HEADS, 1, max_len, config, num_sms)

    def default() -> torch.Tensor:
        return attention.unified_attention(
            *batch.args(), SCALE, max_seqlen_q=1, max_seqlen_k=max_len
        )

    ms = _ms(default)
    eager = _eager_ms(default)
    kind = f"{ctx // 2}-{3 * ctx // 2} ctx" if ragged else f"{ctx} ctx"
    print(f"\ndecode {num_seqs} seqs x {kind}: K/V {nbytes / 1e6:.0f} MB")
    print(
        f"  triton default {config} splits={splits}: {ms * 1e3:8.1f} us  "
        f"{nbytes / ms / 1e6:7.0f} GB/s  err {rel_err(default(), ref):.1e}  (eager {eager * 1e3:.1f} us)"
    )
    if not ragged:  # SDPA's contiguous K/V needs equal contexts
        gqa_ms, full_ms = sdpa_decode_ms(batch)
        print(
            f"  torch SDPA enable_gqa (contiguous K/V): {gqa_ms * 1e3:8.1f} us  "
            f"{nbytes / gqa_ms / 1e6:7.0f} GB/s"
        )
        print(
            f"  torch SDPA K/V expanded to {HEADS} heads: {full_ms * 1e3:8.1f} us  "
            f"{4 * nbytes / full_ms / 1e6:7.0f} GB/s (of 4x the bytes)"
        )
    variants: list[tuple[int, int, int, int]] = []
    if sweep_configs:
        for tile, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            variants.append((tile, warps, stages, splits))
    if sweep_splits:
        shapes_default = (config.tile_n, config.num_warps, config.num_stages)
        shapes = {shapes_default, (64, 4, 2), (128, 4, 2)}
        for (tile, warps, stages), s in itertools.product(
            shapes | set(best[:2]), (1, 2, 4, 8, 16, 32)
        ):
            if s == splits and (tile, warps, stages) == shapes_default:
                continue
            variants.append((tile, warps, stages, s))
    rows = []
    for tile, warps, stages, s in variants:
        cfg = attention.AttentionConfig(16, tile, warps, stages)
        t, err = run_variant(batch, ref, cfg, s)
        rows.append((t, tile, warps, stages, s, err))
    rows.sort()
    if sweep_configs:
        best[:] = [(tile, warps, stages) for _, tile, warps, stages, _, _ in rows[:3]]
    for t, tile, warps, stages, s, err in rows[:10]:
        print(
            f"  sweep tile={tile:3d} warps={warps} stages={stages} splits={s:2d}: "
            f"{t * 1e3:8.1f} us  {nbytes / t / 1e6:7.0f} GB/s  err {err:.1e}"
        )


def serpentine(lens: list[int], row: int) -> list[int]:
    """Longest first, in rows of `row` sequences taken alternately forwards and backwards, so
    when one wave holds every program each SM is not handed the longest of every rank."""
    ranked = sorted(range(len(lens)), key=lambda i: -lens[i])
    rows = [ranked[i : i + row] for i in range(0, len(ranked), row)]
    return [i for r, part in enumerate(rows) for i in (part[::-1] if r % 2 else part)]


def bench_order(num_seqs: int, lo: int, hi: int) -> None:
    """A decode batch of contexts uniform in [lo, hi], timed with the grid over q-blocks or KV
    heads first and its programs' sequences as listed, longest first, or serpentine (rows of a
    wave of programs, alternately reversed), each launched as given; then as the runner
    launches it (longest first, which unified_attention keeps as keeps_seq_order says)."""
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen).tolist()
    print(f"\ndecode {num_seqs} seqs x {lo}-{hi} ctx (grid and sequence order)")
    batch, ref, nbytes = decode_batch(lens)
    num_sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    config = attention.default_config(HEADS // KV_HEADS, 1, HEAD_DIM)
    splits = attention.choose_num_splits(num_seqs, KV_HEADS, 1, hi, config, num_sms)
    true_lens = batch.seq_lens.tolist()
    longest = sorted(range(num_seqs), key=lambda i: -true_lens[i])
    snake = serpentine(true_lens, max(1, num_sms // (KV_HEADS * splits)))
    cases: list[tuple[str, bool, list[int] | None]] = [
        ("listed", False, None),
        ("listed", True, None),
        ("longest first", False, longest),
        ("longest first", True, longest),
        ("serpentine", True, snake),
    ]
    for name, heads_first, order in cases:
        attention.HEADS_FIRST = heads_first
        seq_order = None if order is None else torch.tensor(order, dtype=torch.int32, device=CUDA)

        def call(seq_order: torch.Tensor | None = seq_order) -> torch.Tensor:
            return attention.paged_attention(
                *batch.args(), SCALE, config, splits, seq_order=seq_order
            )

        ms = _ms(call)
        print(
            f"  {name:13s} heads_first={int(heads_first)} splits={splits}: {ms * 1e3:8.1f} us  "
            f"{nbytes / ms / 1e6:7.0f} GB/s  err {rel_err(call(), ref):.1e}"
        )
    attention.HEADS_FIRST = True
    order_t = torch.tensor(longest, dtype=torch.int32, device=CUDA)

    def runner() -> torch.Tensor:
        return attention.unified_attention(
            *batch.args(), SCALE, max_seqlen_q=1, max_seqlen_k=hi, seq_order=order_t
        )

    ms = _ms(runner)
    print(f"  as the runner launches it: {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s")


def bench_mixed(sweep: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q_lens = [2048, 2048, 1024, 1536] + [1] * 60
    ctx = [2048, 0, 4096, 512] + torch.randint(1, 8192, (60,), generator=gen).tolist()
    batch = make_batch(q_lens, ctx, HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE, CUDA, seed=5)
    ref = reference.unified_attention(*batch.args(), SCALE)
    flops = attn_flops(q_lens, ctx)

    def call() -> torch.Tensor:
        return attention.unified_attention(
            *batch.args(), SCALE, max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k
        )

    ms = _ms(call)
    print(f"\nmixed: 4 prefill chunks (6.6k tokens) + 60 decodes: {flops / 1e12:.2f} TFLOP")
    print(
        f"  triton default {attention.default_config(HEADS // KV_HEADS, 2048, HEAD_DIM)}: {ms * 1e3:8.1f} us  "
        f"{flops / ms / 1e9:6.1f} TFLOP/s  err {rel_err(call(), ref):.1e}"
    )
    if not sweep:
        return
    rows = []
    for bm, tile, warps, stages in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
        cfg = attention.AttentionConfig(block_m=bm, tile_n=tile, num_warps=warps, num_stages=stages)
        t, err = run_variant(batch, ref, cfg, 1)
        rows.append((t, bm, tile, warps, stages, err))
    rows.sort()
    for t, bm, tile, warps, stages, err in rows[:6]:
        print(
            f"  sweep block_m={bm:3d} tile={tile:3d} warps={warps} stages={stages}: "
            f"{t * 1e3:8.1f} us  {flops / t / 1e9:6.1f} TFLOP/s  err {err:.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tiles and splits")
    parser.add_argument("--splits", action="store_true", help="also time other split factors")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument(
        "--decode",
        default="64x2048,8x8192,1x32768",
        help="decode batches as SEQSxCONTEXT, comma-separated (the first gets the tile sweep, "
        "the others the split sweep); W4's: 256x1024,24x1536",
    )
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed batch")
    parser.add_argument(
        "--ragged", action="store_true", help="decode contexts uniform in [ctx/2, 3ctx/2]"
    )
    parser.add_argument(
        "--order",
        default="",
        help="decode batches as SEQSxLO-HI, comma-separated: contexts uniform in [LO, HI], "
        "timed with each grid axis order and sequence order, e.g. W4's 256x100-2000",
    )
    args = parser.parse_args()
    global HEADS, KV_HEADS, HEAD_DIM, SCALE
    HEADS, KV_HEADS, HEAD_DIM = SHAPES[args.shape]
    SCALE = HEAD_DIM**-0.5
    print(f"{args.shape}: {HEADS} query heads, {KV_HEADS} KV heads, head dim {HEAD_DIM}")
    props = torch.cuda.get_device_properties(CUDA)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    x = torch.empty(2**30, dtype=torch.uint8, device=CUDA)
    y = torch.empty_like(x)
    copy_ms = _eager_ms(lambda: y.copy_(x))
    print(f"device-to-device copy: {2 * x.numel() / copy_ms / 1e6:.0f} GB/s (read + write)")
    for item in filter(None, args.order.split(",")):
        seqs, span = item.split("x")
        lo, hi = (int(x) for x in span.split("-"))
        bench_order(int(seqs), lo, hi)
    best: list[tuple] = []
    for i, item in enumerate(filter(None, args.decode.split(","))):
        seqs, ctx = (int(x) for x in item.split("x"))
        if i == 0:
            bench_decode(seqs, ctx, args.sweep, args.splits, best, args.ragged)
        else:
            bench_decode(seqs, ctx, False, args.sweep or args.splits, best, args.ragged)
    if not args.no_mixed:
        bench_mixed(args.sweep)


if __name__ == "__main__":
    main()
