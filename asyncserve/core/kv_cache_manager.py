"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing.

Block i of a request holds tokens [i * block_size, (i + 1) * block_size). A block is hashed
(registered for prefix reuse) as soon as it is allocated for a step that fills it: its K/V
are written by that step's forward pass, before any later step can read them, and a request
admitted in the same step reads them only after each layer has stored the whole batch's K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncserve.core.block_pool import BlockPool, KVBlock, hash_block
from asyncserve.core.request import Request


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size != block_pool.block_size:
            raise ValueError(
                f"block_size {block_size} differs from the pool's {block_pool.block_size}"
            )
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and block_pool.enable_prefix_caching
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have gone through cache_full_blocks.
        self._num_cached: dict[str, int] = {}
        # Prefix cache stats in tokens: tokens looked up and tokens found, per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A fresh list of the request's block ids, in token order."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's full blocks, and the tokens it covers.

        Capped at num_tokens - 1 (whole blocks) so the last token is always computed and
        yields logits. Requests that want prompt logprobs need every position's logits and
        skip the cache. Pure lookup: stats are counted by record_prefix_lookup on admission.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        hashes = self._update_block_hashes(request, max_blocks)
        get_cached = self.block_pool.get_cached_block
        hit: list[KVBlock] = []
        for i in range(max_blocks):
            block = get_cached(hashes[i])
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted lookup as vLLM does: queries += num_tokens, hits += hit."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for request.num_computed_tokens + prefix hit + num_new_tokens tokens,
        and num_lookahead_tokens slots past them (a draft model's proposals write there).

        Returns the ids of the newly allocated blocks (prefix-hit blocks not included), or
        None, with nothing taken, when the pool lacks free blocks.
        """
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        num_held = 0 if blocks is None else len(blocks)
        num_hit = len(new_computed_blocks)
        total = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        num_needed = -(-(total + num_lookahead_tokens) // self.block_size) - num_held - num_hit
        # Free hit blocks leave the free list when touched, so they count against it.
        num_available = self.block_pool.num_free_blocks
        for block in new_computed_blocks:
            if block.ref_cnt == 0:
                num_available -= 1
        if num_needed > num_available:
            return None

        if blocks is None:
            blocks = self._req_blocks[rid] = []
            self._num_cached[rid] = 0
        if num_hit:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # Hit blocks are registered already.
            self._num_cached[rid] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)

        if self.enable_prefix_caching:
            # Only blocks whose tokens are all known get a hash: a token still being sampled
            # (async scheduling) is hashed with its block on a later step.
            num_full = min(total, request.num_tokens) // self.block_size
            num_cached = self._num_cached[rid]
            if num_full > num_cached:
                hashes = self._update_block_hashes(request, num_full)
                self.block_pool.cache_full_blocks(blocks, hashes, num_cached, num_full)
                self._num_cached[rid] = num_full
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Give back every block of the request, its last block first.

        Blocks beyond request.num_computed_tokens were hashed for a step that never ran (the
        request was preempted within the same schedule): their hashes are dropped so no
        later request reads K/V that were never written.
        """
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, None)
        self._num_cached.pop(rid, None)
        if not blocks:
            return
        pool = self.block_pool
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.block_hash is not None and block.ref_cnt == 1:
                pool.uncache_block(block)
        pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Extend request.block_hashes to cover its first num_blocks full blocks."""
        hashes = request.block_hashes
        n = len(hashes)
        if n < num_blocks:
            bs = self.block_size
            parent = hashes[-1] if n else None
            for i in range(n, num_blocks):
                parent = hash_block(parent, tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
                hashes.append(parent)
        return hashes
