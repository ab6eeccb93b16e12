"""Launch shapes of the unified paged attention kernel (kernels/attention_kernel.py): tile sizes,
the split-KV factor and whether a decode batch's programs take their sequences longest
first, chosen from the step's shapes alone (no device read)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

# A batch counts as decode-heavy (and may split its keys) when no sequence has more query
# tokens than this in the step (plain decodes, or a few speculative tokens).
_SPLIT_MAX_SEQLEN_Q = 8
_MAX_SPLITS = 32
# Fewest key tiles each split should get; below that the merge costs more than it saves.
_MIN_TILES_PER_SPLIT = 4


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes and launch parameters of one launch."""

    block_m: int  # rows of a program's tile: block_q query tokens x GROUP heads (power of 2)
    tile_n: int  # keys per iteration (power of 2, >= 16)
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs on CPU: assume an H100-sized chip


@functools.cache
def large_shared_memory(device: torch.device) -> bool:
    """Whether a block may use Hopper's ~227 KB of shared memory (the head-dim-256 tiles
    below need it); the interpreter on CPU counts as an H100."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024
    return True


def default_config(
    group: int, max_seqlen_q: int, head_dim: int = 128, large_smem: bool = True
) -> AttentionConfig:
    """Tiles for decode-like launches (16 rows) or prefill-carrying ones (64 rows; 128 at
    head dim 256 where shared memory allows).

    Chosen on an H100 (benchmarks/bench_kernels.py --sweep, benchmarks/kernels_h100.md):
    for decodes at head dim 128, tile, warps and stages move the time by under 2% (128-key
    tiles gain 8% on one 32k sequence but need twice the shared memory); for prefill, 64
    rows beat 128. At head dim 256 (Gemma 3, --shape gemma3-4b) a third stage takes decodes
    from 2,410-2,527 to 2,684-2,796 GB/s, and 128 rows with 8 warps and 3 stages take a
    mixed prefill launch from 1,094 to 957 us.
    """
    decode = max_seqlen_q <= _SPLIT_MAX_SEQLEN_Q
    rows, warps, stages = (16, 4, 2) if decode else (64, 4, 2)
    if head_dim >= 256 and large_smem:
        rows, warps, stages = (16, 4, 3) if decode else (128, 8, 3)
    block_m = max(rows, triton.next_power_of_2(group))
    return AttentionConfig(block_m=block_m, tile_n=64, num_warps=warps, num_stages=stages)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: AttentionConfig,
    num_sms: int,
) -> int:
    """Split-KV factor: >1 only for decode-heavy batches that leave the chip under-filled."""
    if max_seqlen_q > _SPLIT_MAX_SEQLEN_Q:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:  # about two programs per SM keep the loads in flight
        return 1
    # Between one and two programs an SM, eight splits beat two on ragged decodes (Qwen3-0.6B
    # heads on an H200, bench_kernels.py --ragged --splits: 17 sequences of 750-2,250 keys
    # 35.5 against 52.1 us, 24 sequences 47.1 against 59.0, 32 sequences 62.1 against 62.6).
    target = 8 * num_sms if programs >= num_sms else 2 * num_sms
    max_by_length = triton.cdiv(max_seqlen_k, config.tile_n) // _MIN_TILES_PER_SPLIT
    splits = min(triton.cdiv(target, programs), max_by_length, _MAX_SPLITS)
    if splits < 2:
        return 1
    return triton.next_power_of_2(splits)


# A decode launch of fewer programs an SM ignores seq_order (keeps_seq_order).
_ORDER_MIN_PROGRAMS_PER_SM = 4


def block_q(config: AttentionConfig, group: int) -> int:
    """Query tokens a program takes: its rows (at least one token's GROUP heads) / GROUP."""
    return max(config.block_m, triton.next_power_of_2(group)) // group


def keeps_seq_order(
    config: AttentionConfig, group: int, max_seqlen_q: int, programs: int, num_sms: int
) -> bool:
    """Whether a launch of `programs` programs takes a seq_order: every sequence's query tokens
    must fit one q-block, and the grid must span several waves. Longest first lets the
    last wave end together; when about one wave holds every program, a sorted order hands
    each SM the longest of each rank instead (H200, 16 query / 8 KV heads, contexts of
    100-2000, benchmarks/bench_kernels.py --order, 132 SMs: 64 sequences, 512 programs,
    90.3 -> 103.7 us with the order; 24 sequences of 8 splits, 1,536 programs, 40.6 -> 37.6;
    128 and 256 sequences 156.4 -> 125.0 and 274.7 -> 241.4). The threshold lies between
    the 3.9 and 7.8 programs an SM measured."""
    return (
        max_seqlen_q <= block_q(config, group) and programs >= _ORDER_MIN_PROGRAMS_PER_SM * num_sms
    )
