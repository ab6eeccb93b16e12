"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing.

Block i of a request holds tokens [i * block_size, (i + 1) * block_size). A block is hashed
(registered for prefix reuse) as soon as it is allocated for a step that fills it: its K/V
are written by that step's forward pass, before any later step can read them, and a request
admitted in the same step reads them only after each layer has stored the whole batch's K/V.

Sliding window (`sliding_window` W, set only when EVERY layer of the model uses a window): a
query at position p reads keys at positions > p - W only, so a block wholly before the first
query of a step minus W is never read again and goes back to the pool at once (or, for a prefix
hit, is never taken). Its table entry stays as a hole (None; the runner sees block 0 there, which
the kernels mask out) so block i still holds tokens [i * bs, (i + 1) * bs). A freed block keeps
its hash: its K/V stay valid for a later prefix hit until the pool evicts it. Models that mix
windowed and global layers (Gemma 3) pass None: their global layers read every block.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncserve.core.block_pool import BlockPool, KVBlock, hash_block
from asyncserve.core.request import Request, RequestStatus

# A request that ended normally keeps its prompt blocks for a consumer to pull.
_EXPORTABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class KVCacheManager:
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
    ) -> None:
        if block_size != block_pool.block_size:
            raise ValueError(
                f"block_size {block_size} differs from the pool's {block_pool.block_size}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and block_pool.enable_prefix_caching
        self.sliding_window = sliding_window
        # None marks a block freed because it left the window.
        self._req_blocks: dict[str, list[KVBlock | None]] = {}
        # How many leading blocks of each request have gone through cache_full_blocks.
        self._num_cached: dict[str, int] = {}
        # Disaggregated prefill: request id -> the prompt blocks a consumer may still pull.
        self.exports: dict[str, list[KVBlock]] = {}
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
        """A fresh list of the request's block ids, in token order (0 for a block that left
        the sliding window: never read unmasked, and always a valid index)."""
        return [0 if b is None else b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (holes left by the sliding window not counted)."""
        return sum(b is not None for b in self._req_blocks.get(request_id, ()))

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
        if blocks is not None and not new_computed_blocks and self.sliding_window is None:
            # Most decodes: room left in the last block and no block newly full.
            bs = self.block_size
            total = request.num_computed_tokens + num_new_tokens
            if -(-(total + num_lookahead_tokens) // bs) <= len(blocks) and (
                not self.enable_prefix_caching
                or total // bs <= self._num_cached[rid]  # no block newly full, known or not
                or min(total, request.num_tokens) // bs <= self._num_cached[rid]
            ):
                return []
        num_held = 0 if blocks is None else len(blocks)
        num_hit = len(new_computed_blocks)
        first_query = request.num_computed_tokens + num_hit * self.block_size
        total = first_query + num_new_tokens
        num_needed = -(-(total + num_lookahead_tokens) // self.block_size) - num_held - num_hit
        # Blocks before this many are out of every query's window from this step on.
        num_skipped = self._num_skipped_blocks(first_query)
        if blocks is not None:
            self._free_skipped(blocks, num_skipped)
        # Hit blocks left of the window are not taken at all.
        kept_hits = list(new_computed_blocks[max(num_skipped - num_held, 0) :])
        # Free hit blocks leave the free list when touched, so they count against it.
        num_available = self.block_pool.num_free_blocks
        for block in kept_hits:
            if block.ref_cnt == 0:
                num_available -= 1
        if num_needed > num_available:
            return None

        if blocks is None:
            blocks = self._req_blocks[rid] = []
            self._num_cached[rid] = 0
        if num_hit:
            self.block_pool.touch(kept_hits)
            blocks.extend([None] * (num_hit - len(kept_hits)))
            blocks.extend(kept_hits)
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
        params = request.sampling_params.kv_transfer_params
        if params and params.get("do_remote_decode") and request.status in _EXPORTABLE:
            self._hold_for_export(request, blocks)
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block is not None and block.block_hash is not None and block.ref_cnt == 1:
                pool.uncache_block(block)
        pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- disaggregated prefill ---------------------------------------------------------------

    def _hold_for_export(self, request: Request, blocks: Sequence[KVBlock | None]) -> None:
        """Keep the request's full prompt blocks (cached under their hashes) referenced
        until a consumer pulls them or the hold expires (release_export)."""
        full = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
        # Blocks a sliding window dropped already (None) are not sent.
        held = [b for b in blocks[:full] if b is not None and b.block_hash is not None]
        self.block_pool.touch(held)
        self.release_export(request.request_id)  # a request id reused: drop the older hold
        self.exports[request.request_id] = held

    def release_export(self, request_id: str) -> None:
        held = self.exports.pop(request_id, None)
        if held:
            self.block_pool.free_blocks(reversed(held))

    def prompt_block_hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of a prompt's full blocks, as its request would get them."""
        bs = self.block_size
        hashes: list[int] = []
        parent: int | None = None
        for i in range(len(prompt_token_ids) // bs):
            parent = hash_block(parent, tuple(prompt_token_ids[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def cached_blocks(self, block_hashes: Sequence[int]) -> list[KVBlock | None]:
        get = self.block_pool.get_cached_block
        return [get(h) for h in block_hashes]

    def take_blocks_for_import(self, n: int) -> list[KVBlock] | None:
        """n free blocks to write pulled K/V into (referenced until register_imported), or
        None when the pool has no room (the request then computes its prefix itself)."""
        if n > self.block_pool.num_free_blocks:
            return None
        return self.block_pool.get_new_blocks(n)

    def register_imported(self, blocks: list[KVBlock], block_hashes: Sequence[int]) -> None:
        """Pulled blocks join the prefix cache under their hashes, free and evictable: the
        request that needs them takes them back as a prefix hit."""
        self.block_pool.cache_full_blocks(blocks, block_hashes, 0, len(blocks))
        self.block_pool.free_blocks(reversed(blocks))

    def _num_skipped_blocks(self, first_query: int) -> int:
        """Leading blocks no query at position >= first_query can see through the window."""
        if self.sliding_window is None:
            return 0
        return max(first_query - self.sliding_window + 1, 0) // self.block_size

    def _free_skipped(self, blocks: list[KVBlock | None], num_skipped: int) -> None:
        """Give back the held blocks among the first num_skipped, last first (as free does)."""
        gone: list[KVBlock] = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is None:
                break  # everything before a hole was freed with it
            gone.append(block)
            blocks[i] = None
        if gone:
            self.block_pool.free_blocks(gone)

    def _update_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Extend request.block_hashes to cover its first num_blocks full blocks."""
        hashes = request.block_hashes
        n = len(hashes)
        if n < num_blocks:
            bs = self.block_size
            parent = hashes[-1] if n else None
            lora_id = request.lora_int_id
            mm = request.mm_features
            for i in range(n, num_blocks):
                tokens = tuple(request.token_ids_slice(i * bs, (i + 1) * bs))
                # Same placeholder tokens, different image: a different block.
                extra = mm.block_extra_keys(i * bs, (i + 1) * bs) if mm is not None else ()
                parent = hash_block(parent, tokens, lora_id, extra)
                hashes.append(parent)
        return hashes
