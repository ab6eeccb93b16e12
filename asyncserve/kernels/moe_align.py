"""Sorting a MoE layer's (token, slot) pairs by expert, each expert's run padded to whole
BLOCK_M tiles (step 2 of kernels/moe.py's flow).

Two implementations, the same results:
- `align_by_expert_torch`: about thirty torch operations (counts, a stable sort, prefix sums,
  scatters), any number of pairs. Each is a kernel on the device, which costs little beside a
  prefill's GEMMs but at batch 1 is most of a MoE layer's kernels: a decode step's CUDA graph
  of a 32-layer MoE model then replays about a thousand tiny kernels for the sorting alone.
- `_align_small_kernel`: the whole sort in one program of one launch, for up to
  SMALL_MAX_PAIRS pairs (decode batches). With so few pairs every count is a comparison
  matrix reduced in registers: a pair's rank within its expert is how many earlier pairs
  share its expert, its expert's start how many tiles the smaller experts fill.
- Past that, three launches over chunks of CHUNK pairs (`_align_count_kernel`,
  `_align_offsets_kernel`, `_align_place_kernel`): pairs per (chunk, expert), then one
  program's prefix sums over chunks and experts, then each chunk placing its pairs at its
  expert's start + the earlier chunks' pairs of that expert + its rank within the chunk.
All place an expert's pairs in their original order (stable), so their outputs are equal.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Pairs (tokens x top_k) and local experts (plus the bucket of other ranks' experts) the
# one-program kernel takes; past them the torch path runs.
SMALL_MAX_PAIRS = 128
SMALL_MAX_EXPERTS = 255
# Tiles and sorted rows handled per loop step (the [tiles, experts] comparison's rows).
_TILE_CHUNK = 64
_FILL_CHUNK = 1024
# Pairs per program of the chunked path; chunk rows per step of its prefix sums.
CHUNK = 64
_PREFIX_ELEMENTS = 8192


def max_sorted_len(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: every pair, plus block_m - 1 padding per expert that
    any pair can reach, in whole tiles."""
    max_len = num_pairs + min(num_local_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(max_len, block_m) * block_m


def align_by_expert_torch(
    topk_ids: torch.Tensor, block_m: int, num_local_experts: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See align_by_expert."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    experts = topk_ids.reshape(-1).long()
    if expert_map is not None:
        experts = expert_map.long()[experts]
    # Other ranks' experts go to an extra bucket that is sorted last and gets no tile.
    experts = torch.where(experts < 0, num_local_experts, experts)
    # scatter_add, not bincount: CUDA's bincount reads the max back to the host, which a
    # CUDA graph capture cannot do.
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    start = torch.cumsum(counts, 0) - counts
    padded = (counts[:num_local_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    max_len = max_sorted_len(num_pairs, num_local_experts, block_m)
    padded_start = torch.cat(
        [padded_end - padded, torch.full((1,), max_len, dtype=padded.dtype, device=device)]
    )
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    # Dropped pairs land past max_len, in a tail that is cut off.
    dest = torch.where(sorted_experts == num_local_experts, max_len + rank, dest)
    sorted_ids = torch.full((max_len + num_pairs,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_len, block_m, device=device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_local_experts, tile_experts, -1)
    return sorted_ids[:max_len], tile_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _store_tiles(
    tiles_ptr, num_sorted_ptr, padded, padded_end, local, num_experts, max_len,
    BLOCK_M: tl.constexpr, TILE_CHUNK: tl.constexpr,
):  # fmt: skip
    """Each tile's expert (how many local experts end at or before the tile's first row, -1
    past the last) and the padded length, from the experts' padded run lengths."""
    for t0 in range(0, max_len // BLOCK_M, TILE_CHUNK):
        tile = t0 + tl.arange(0, TILE_CHUNK)
        ended = (padded_end[None, :] <= (tile * BLOCK_M)[:, None]) & local[None, :]
        owner = tl.sum(ended.to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(tiles_ptr + tile, owner, mask=tile < max_len // BLOCK_M)
    tl.store(num_sorted_ptr, tl.sum(padded, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "max_len"])  # both change every step
def _align_small_kernel(
    ids_ptr,  # [P] int32 global expert ids
    map_ptr,  # [E_global] int32 local index or -1 (HAS_MAP)
    sorted_ptr,  # [max_len] int32 out
    tiles_ptr,  # [max_len / BLOCK_M] int32 out
    num_sorted_ptr,  # [1] int32 out
    num_pairs,
    num_experts,  # local experts
    max_len,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
    FILL_CHUNK: tl.constexpr,
):
    # Every row is padding until a pair is placed in it.
    for f0 in range(0, max_len, FILL_CHUNK):
        offs = f0 + tl.arange(0, FILL_CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([FILL_CHUNK], tl.int32) + num_pairs, offs < max_len)
    pair = tl.arange(0, P_PAD)
    valid = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=valid, other=0)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert, mask=valid, other=-1)
    # Other ranks' experts (and the lanes past the pairs) go to bucket num_experts: no tile.
    expert = tl.where(valid & (expert >= 0), expert, num_experts)
    # Pairs per expert, from a [pairs, experts] one-hot matrix.
    bucket = tl.arange(0, E_PAD)
    one_hot = (expert[:, None] == bucket[None, :]) & valid[:, None]
    counts = tl.sum(one_hot.to(tl.int32), axis=0)  # [E_PAD]
    local = bucket < num_experts
    padded = tl.where(local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    # Each pair: its expert's first row, and how many earlier pairs share its expert.
    start = tl.sum(tl.where(one_hot, padded_start[None, :], 0), axis=1)  # [P_PAD]
    earlier = pair[None, :] < pair[:, None]  # [i, j]: pair j comes before pair i
    same = expert[:, None] == expert[None, :]
    rank = tl.sum((same & earlier & valid[None, :]).to(tl.int32), axis=1)
    # The padding stores above must land before the pairs' stores to the same rows.
    tl.debug_barrier()
    tl.store(sorted_ptr + start + rank, pair, mask=valid & (expert < num_experts))
    _store_tiles(tiles_ptr, num_sorted_ptr, padded, padded_end, local, num_experts, max_len,
                 BLOCK_M, TILE_CHUNK)  # fmt: skip


@triton.jit
def _local_experts(ids_ptr, map_ptr, pair, valid, num_experts, HAS_MAP: tl.constexpr):
    """Each pair's local expert (through the expert-parallel map) and whether it is one."""
    expert = tl.load(ids_ptr + pair, mask=valid, other=0)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert, mask=valid, other=-1)
    return expert, valid & (expert >= 0) & (expert < num_experts)


@triton.jit(do_not_specialize=["num_pairs", "max_len", "fill_per_chunk"])
def _align_count_kernel(
    ids_ptr,  # [P] int32 global expert ids
    map_ptr,  # [E_global] int32 local index or -1 (HAS_MAP)
    counts_ptr,  # [chunks, E] int32, zeroed: pairs per (chunk, local expert)
    sorted_ptr,  # [max_len] int32 out: every row set to the padding sentinel here
    num_pairs,
    num_experts,
    max_len,
    fill_per_chunk,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL_CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    f_begin = chunk * fill_per_chunk
    for f0 in range(0, fill_per_chunk, FILL_CHUNK):
        offs = f_begin + f0 + tl.arange(0, FILL_CHUNK)
        keep = (offs < f_begin + fill_per_chunk) & (offs < max_len)
        tl.store(sorted_ptr + offs, tl.zeros([FILL_CHUNK], tl.int32) + num_pairs, keep)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = pair < num_pairs
    expert, local = _local_experts(ids_ptr, map_ptr, pair, valid, num_experts, HAS_MAP)
    # Integer sums: the atomics' order does not change the counts.
    tl.atomic_add(counts_ptr + chunk * num_experts + expert, 1, mask=local)


@triton.jit(do_not_specialize=["num_chunks", "max_len"])
def _align_offsets_kernel(
    counts_ptr,  # [chunks, E] int32 in: counts; out: the earlier chunks' pairs per expert
    starts_ptr,  # [E] int32 out: each expert's first row
    tiles_ptr,  # [max_len / BLOCK_M] int32 out
    num_sorted_ptr,  # [1] int32 out
    num_chunks,
    num_experts,
    max_len,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
):
    bucket = tl.arange(0, E_PAD)
    local = bucket < num_experts
    totals = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        row = c0 + tl.arange(0, ROWS)
        at = counts_ptr + row[:, None] * num_experts + bucket[None, :]
        keep = (row[:, None] < num_chunks) & local[None, :]
        counts = tl.load(at, mask=keep, other=0)
        tl.store(at, tl.cumsum(counts, axis=0) - counts + totals[None, :], mask=keep)
        totals += tl.sum(counts, axis=0)
    padded = tl.where(local, (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + bucket, padded_end - padded, mask=local)
    _store_tiles(tiles_ptr, num_sorted_ptr, padded, padded_end, local, num_experts, max_len,
                 BLOCK_M, TILE_CHUNK)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _align_place_kernel(
    ids_ptr,
    map_ptr,
    prefix_ptr,  # [chunks, E] int32: the earlier chunks' pairs per expert
    starts_ptr,  # [E] int32
    sorted_ptr,  # [max_len] int32 out
    num_pairs,
    num_experts,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pair = chunk * CHUNK + lane
    valid = pair < num_pairs
    expert, local = _local_experts(ids_ptr, map_ptr, pair, valid, num_experts, HAS_MAP)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: pair j comes before pair i
    same = (expert[:, None] == expert[None, :]) & local[None, :]
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)
    safe = tl.where(local, expert, 0)
    start = tl.load(starts_ptr + safe, mask=local, other=0)
    before = tl.load(prefix_ptr + chunk * num_experts + safe, mask=local, other=0)
    tl.store(sorted_ptr + start + before + rank, pair, mask=local)


def _align_chunked(
    ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    block_m: int,
    num_local_experts: int,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    sorted_ids, tile_experts, num_sorted = outputs
    num_pairs, max_len = ids.numel(), sorted_ids.numel()
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    counts = torch.zeros(num_chunks, num_local_experts, dtype=torch.int32, device=ids.device)
    starts = torch.empty(num_local_experts, dtype=torch.int32, device=ids.device)
    mapping = expert_map.to(torch.int32) if expert_map is not None else ids
    has_map = expert_map is not None
    _align_count_kernel[(num_chunks,)](
        ids, mapping, counts, sorted_ids, num_pairs, num_local_experts, max_len,
        triton.cdiv(max_len, num_chunks),
        HAS_MAP=has_map, CHUNK=CHUNK, FILL_CHUNK=_FILL_CHUNK, num_warps=4,
    )  # fmt: skip
    e_pad = max(16, triton.next_power_of_2(num_local_experts))
    _align_offsets_kernel[(1,)](
        counts, starts, tile_experts, num_sorted, num_chunks, num_local_experts, max_len,
        BLOCK_M=block_m, E_PAD=e_pad, ROWS=max(2, _PREFIX_ELEMENTS // e_pad),
        TILE_CHUNK=_TILE_CHUNK, num_warps=8,
    )  # fmt: skip
    _align_place_kernel[(num_chunks,)](
        ids, mapping, counts, starts, sorted_ids, num_pairs, num_local_experts,
        HAS_MAP=has_map, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip


def align_by_expert(
    topk_ids: torch.Tensor, block_m: int, num_local_experts: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, tile_experts, num_sorted): the flat (token, slot) ids grouped by local
    expert, each group padded to a multiple of block_m with the sentinel T * k; the expert of
    each block_m tile (-1 past the end); and the padded length, as a device tensor [1].
    On the GPU (or under the interpreter) one kernel for up to SMALL_MAX_PAIRS pairs, three
    past that; the torch operations elsewhere."""
    num_pairs = topk_ids.numel()
    on_triton = topk_ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not on_triton or num_pairs == 0:
        return align_by_expert_torch(topk_ids, block_m, num_local_experts, expert_map)
    device = topk_ids.device
    max_len = max_sorted_len(num_pairs, num_local_experts, block_m)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=device)
    tile_experts = torch.empty(max_len // block_m, dtype=torch.int32, device=device)
    num_sorted = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1).to(torch.int32)
    if num_pairs > SMALL_MAX_PAIRS or num_local_experts > SMALL_MAX_EXPERTS:
        _align_chunked(ids, expert_map, block_m, num_local_experts,
                       (sorted_ids, tile_experts, num_sorted))  # fmt: skip
        return sorted_ids, tile_experts, num_sorted
    expert_map_i32 = expert_map.to(torch.int32) if expert_map is not None else ids
    _align_small_kernel[(1,)](
        ids,
        expert_map_i32,
        sorted_ids,
        tile_experts,
        num_sorted,
        num_pairs,
        num_local_experts,
        max_len,
        HAS_MAP=expert_map is not None,
        BLOCK_M=block_m,
        P_PAD=max(16, triton.next_power_of_2(num_pairs)),
        E_PAD=max(16, triton.next_power_of_2(num_local_experts + 1)),
        TILE_CHUNK=_TILE_CHUNK,
        FILL_CHUNK=_FILL_CHUNK,
        num_warps=4,
    )
    return sorted_ids, tile_experts, num_sorted
