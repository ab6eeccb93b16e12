"""Whether one request fits the KV pool, and the max_model_len a pool allows.

A request of n tokens holds ceil(n / block_size) blocks, except when every layer attends
through a sliding window: then at most the window behind a step's first query, the step's
tokens and a partial block at each end. A pool too small for one max_model_len request is
refused at start-up (as vLLM does) when max_model_len was asked for, and lowers the
model's own length otherwise, so that no admitted request can fail for want of blocks.
"""

from __future__ import annotations

import logging

from asyncserve.config import EngineConfig

logger = logging.getLogger(__name__)


def blocks_needed(
    num_tokens: int, block_size: int, sliding_window: int | None, max_num_batched_tokens: int
) -> int:
    if sliding_window is not None:
        num_tokens = min(num_tokens, sliding_window + max_num_batched_tokens + 2 * block_size)
    return -(-num_tokens // block_size)


def fit_max_model_len(
    max_model_len: int, config: EngineConfig, num_blocks: int, sliding_window: int | None
) -> int:
    """max_model_len, or the most tokens the pool holds for one request when it holds fewer
    and max_model_len was the model's own; a ValueError when the config asked for it."""
    block_size = config.cache.block_size
    max_num_batched_tokens = config.scheduler.max_num_batched_tokens
    if (
        blocks_needed(max_model_len, block_size, sliding_window, max_num_batched_tokens)
        <= num_blocks
    ):
        return max_model_len
    capacity = num_blocks * block_size
    if config.model.max_model_len is not None:
        raise ValueError(
            f"max_model_len {max_model_len} is more than the KV cache holds for one request "
            f"({capacity} tokens in {num_blocks} blocks of {block_size}); raise "
            f"gpu_memory_utilization or kv_cache_memory, or set max_model_len <= {capacity}"
        )
    logger.warning(
        "the KV cache holds %d tokens (%d blocks of %d), fewer than the model's length %d: "
        "max_model_len is %d",
        capacity, num_blocks, block_size, max_model_len, capacity,
    )  # fmt: skip
    return capacity
