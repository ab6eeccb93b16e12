"""The ranks of a data-parallel launch in vLLM's SPMD shape (one process and one LLM per
rank, placed by ASYNCSERVE_DP_* variables; examples/data_parallel.py) as one gloo group.

The ranks share no model state: each runs its own engine on its own prompts. The group
lines them up: every rank has joined before any loads, every rank has loaded before any
generates, and no rank tears down while another is still generating.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from asyncserve.config import DataParallelRank

logger = logging.getLogger(__name__)

# How long a rank waits for the others at each line-up.
_TIMEOUT = timedelta(minutes=10)


class DataParallelGroup:
    def __init__(self, place: DataParallelRank) -> None:
        self.rank = place.rank
        self.size = place.size
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process")
        init_method = f"tcp://{place.master_ip}:{place.master_port}"
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=place.rank,
            world_size=place.size,
            timeout=_TIMEOUT,
        )
        logger.info("data-parallel rank %d of %d joined %s", place.rank, place.size, init_method)
        self._open = True

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Wait for every rank to finish, then leave the group."""
        if not self._open:
            return
        self._open = False
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
