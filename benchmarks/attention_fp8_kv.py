"""A W3-like mixed step's attention (one 512-token prompt beside 15 decodes of 600-key
contexts, Llama-3-8B's heads) over a bf16 KV cache and over an fp8 one: the device time of
unified_attention and of the K/V store for each, and the fp8 launch at other tiles.

    python benchmarks/attention_fp8_kv.py [--reps 50]

Prints one JSON line per row: cache dtype, tile (block_m, tile_n, warps, stages), ms a call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels.attention import paged_attention, unified_attention  # noqa: E402
from asyncserve.kernels.attention_config import AttentionConfig  # noqa: E402
from asyncserve.kernels.kv_store import store_kv  # noqa: E402
from benchmarks.graph_timing import time_ms  # noqa: E402

CUDA = torch.device("cuda")
HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--context", type=int, default=600)
    args = parser.parse_args()
    q_lens = [args.prompt] + [1] * args.decodes
    seq_lens = [args.prompt] + [args.context] * args.decodes
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    width = max(blocks_per_seq)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    next_block = 1
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = torch.arange(next_block, next_block + count)
        next_block += count
    table = table.to(CUDA)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, DIM, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, DIM, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BLOCK, device=CUDA)[:tokens]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (num_blocks, BLOCK, KV_HEADS, DIM)
        kc = (torch.randn(shape, device=CUDA) * 0.5).to(dtype)
        vc = (torch.randn(shape, device=CUDA) * 0.5).to(dtype)
        name = "fp8" if dtype != torch.bfloat16 else "bf16"
        store = time_ms([lambda kc=kc, vc=vc: store_kv(k, v, kc, vc, slots, 1.0, 1.0)], args.reps)
        attend = time_ms(
            [
                lambda kc=kc, vc=vc: unified_attention(
                    q, kc, vc, cu, lens, table, DIM**-0.5, args.prompt, max(seq_lens)
                )
            ],  # fmt: skip
            args.reps,
        )
        print(json.dumps({"kv": name, "tile": "default", "attention_ms": round(attend, 4),
                          "store_ms": round(store, 4)}), flush=True)  # fmt: skip
        for block_m, tile_n, warps, stages in (
            (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 4, 2), (64, 64, 8, 2),
            (128, 64, 8, 2), (32, 64, 4, 2),
        ):  # fmt: skip
            config = AttentionConfig(block_m, tile_n, warps, stages)
            try:
                ms = time_ms(
                    [
                        lambda kc=kc, vc=vc, c=config: paged_attention(
                            q, kc, vc, cu, lens, table, DIM**-0.5, c, 1
                        )
                    ],  # fmt: skip
                    args.reps,
                )
            except Exception as exc:  # noqa: BLE001  (a tile past shared memory)
                print(json.dumps({"kv": name, "tile": [block_m, tile_n, warps, stages],
                                  "error": str(exc)[:80]}))  # fmt: skip
                continue
            print(json.dumps({"kv": name, "tile": [block_m, tile_n, warps, stages],
                              "attention_ms": round(ms, 4)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
