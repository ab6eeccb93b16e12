"""The paged KV block pool: ref-counted blocks, an O(1) LRU free list and a prefix-hash map.

Every block is either in use (ref_cnt > 0) or in the free list. A free block may still hold
a hash: its K/V stay valid and a later request with the same prefix can take it back with
`touch` until `get_new_blocks` evicts it. Eviction takes the head of the free list, so the
least recently freed cached block goes first.

No block is reserved as a null block: the runner pads slot mappings with -1 and reads block
tables only up to each sequence's length, so all `num_blocks` blocks hold K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Parent of the first block of every sequence; any fixed int works.
_ROOT_HASH = 0x5EED_CAFE


def hash_block(
    parent_hash: int | None,
    token_ids: tuple[int, ...],
    lora_int_id: int = 0,
    extra_keys: tuple[int, ...] = (),
) -> int:
    """Chained hash of one full block: its tokens and the hash of every block before it.

    The first block's parent is a root per LoRA adapter (`lora_int_id`, 0 for none), so
    K/V computed with one adapter are never served to a request with another.

    The builtin hash of a tuple of ints is fast and stable within one process (int hashing
    does not depend on PYTHONHASHSEED), but it is 64-bit and not cryptographic, so the
    values must never be shared across processes or trusted against adversarial prompts.
    """
    if parent_hash is None:
        parent_hash = _ROOT_HASH if lora_int_id == 0 else hash((_ROOT_HASH, lora_int_id))
    if extra_keys:  # the hashes of the images whose placeholders the block holds
        return hash((parent_hash, token_ids, extra_keys))
    return hash((parent_hash, token_ids))


class KVBlock:
    """One block of `block_size` token slots in the paged cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is full and registered in the pool's prefix map.
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = next to reuse. OrderedDict gives O(1) pop at the head, append at the tail
        # and removal from the middle (a prefix hit on a free cached block).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix map, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some request."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free list, evicting their cached hashes."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        popitem = self._free.popitem
        out: list[KVBlock] = []
        for _ in range(n):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit), pulling free ones out."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero become free.

        Cached blocks go to the tail in the given order, so callers pass a request's blocks
        last first and its tail is evicted before its shared prefix. Uncached blocks hold
        nothing worth keeping and go to the head, to be reused before any cached block.
        """
        free = self._free
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"double free of block {block.block_id}")

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock | None],
        block_hashes: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their chained hashes.

        A block whose hash already maps to another block (the same prefix computed twice)
        stays unregistered: the map keeps one block per hash and the duplicate is freed as a
        plain block. A hole (None: a block freed when it left a sliding window) stays one.
        """
        if not self.enable_prefix_caching:
            return
        cached = self._cached
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block is None or block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash not in cached:
                cached[block_hash] = block
                block.block_hash = block_hash

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash, e.g. when its K/V were never written (preempted first)."""
        if block.block_hash is not None:
            self._evict(block)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
