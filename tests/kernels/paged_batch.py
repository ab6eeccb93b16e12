"""Builders of paged-attention batches shared by the kernel tests and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensor arguments of unified_attention, in order."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
        )


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None = None,
    blocks_at_end: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """A batch of sequences with q_lens[b] new tokens after ctx_lens[b] cached ones.

    Block tables are a random permutation of pool blocks (non-contiguous); unused table
    entries point at random blocks too, and only the used blocks hold random data (the
    rest of the pool is NaN, so a kernel that reads past a context shows it).
    With blocks_at_end the used blocks are the last ones of the pool. Layout is drawn on
    the CPU, data on the device (fast at GPU sizes), both from seed.
    """
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    needed = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = needed + 7
    if num_blocks < needed:
        raise ValueError(f"pool of {num_blocks} blocks is smaller than the {needed} needed")
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)

    first = num_blocks - needed if blocks_at_end else 0
    span = needed if blocks_at_end else num_blocks
    perm = torch.randperm(span, generator=gen)[:needed] + first
    block_tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=gen)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = perm[used : used + nb]
        used += nb
    used_ids = perm.to(device)
    shape = (needed, block_size, num_kv_heads, head_dim)
    key_cache[used_ids] = torch.randn(shape, generator=data_gen, device=device, dtype=dtype)
    value_cache[used_ids] = torch.randn(shape, generator=data_gen, device=device, dtype=dtype)

    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(
        (cu[-1], num_heads, head_dim), generator=data_gen, device=device, dtype=dtype
    )
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(torch.int32).to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    diff = (out.double() - ref.double()).norm().item()
    err = diff / max(ref.double().norm().item(), 1e-30)
    return err if err == err else float("inf")
