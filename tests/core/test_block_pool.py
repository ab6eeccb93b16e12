from __future__ import annotations

import pytest

from asyncserve.core.block_pool import BlockPool, KVBlock, hash_block


def cache(pool: BlockPool, blocks: list[KVBlock], hashes: list[int]) -> None:
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks))


def test_allocate_and_free_accounting() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert len({b.block_id for b in blocks}) == 3
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_get_new_blocks_raises_when_short() -> None:
    pool = BlockPool(num_blocks=2, block_size=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_detected() -> None:
    pool = BlockPool(num_blocks=2, block_size=4, enable_prefix_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_hash_chain() -> None:
    a = hash_block(None, (1, 2, 3, 4))
    assert a == hash_block(None, (1, 2, 3, 4))
    assert a != hash_block(None, (1, 2, 3, 5))
    b = hash_block(a, (5, 6, 7, 8))
    # Same tokens under another parent hash to something else.
    assert b != hash_block(None, (5, 6, 7, 8))
    assert b != hash_block(hash_block(None, (0, 2, 3, 4)), (5, 6, 7, 8))


def test_cached_free_blocks_are_evicted_in_lru_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=2, enable_prefix_caching=True)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(3)
    cache(pool, first, [11, 12, 13])
    cache(pool, second, [21, 22, 23])
    assert pool.num_cached_blocks == 6
    # Free one request, then the other, each last block first.
    pool.free_blocks(reversed(first))
    pool.free_blocks(reversed(second))
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 6

    # The least recently freed go first: first's tail, then its middle, then its head.
    evicted = pool.get_new_blocks(2)
    assert evicted == [first[2], first[1]]
    assert all(b.block_hash is None for b in evicted)
    assert pool.get_cached_block(13) is None and pool.get_cached_block(12) is None
    assert pool.get_cached_block(11) is first[0]
    assert pool.get_cached_block(21) is second[0]
    assert pool.num_cached_blocks == 4
    assert pool.get_new_blocks(2) == [first[0], second[2]]


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(4)
    cache(pool, blocks[:2], [1, 2])
    pool.free_blocks(reversed(blocks))
    taken = pool.get_new_blocks(2)
    assert {b.block_id for b in taken} == {blocks[2].block_id, blocks[3].block_id}
    assert pool.get_cached_block(1) is blocks[0] and pool.get_cached_block(2) is blocks[1]


def test_touch_takes_a_cached_free_block_back() -> None:
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [7, 8])
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(7)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    # Shared by a second holder: freeing once keeps it in use.
    pool.touch([hit])
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    # Allocation never hands out a block in use, and evicts the other cached one.
    others = pool.get_new_blocks(2)
    assert hit not in others and pool.get_cached_block(8) is None
    pool.free_blocks([hit])
    pool.free_blocks(others)
    assert pool.num_free_blocks == 3 and pool.get_cached_block(7) is hit


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    cache(pool, [a], [5])
    cache(pool, [b], [5])
    assert pool.get_cached_block(5) is a
    assert b.block_hash is None
    # Freeing the duplicate does not disturb the registered block.
    pool.free_blocks([b])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(5) is a


def test_cache_full_blocks_respects_range_and_disable() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [1, 2, 3, 4], 1, 3)
    assert [b.block_hash for b in blocks] == [None, 2, 3, None]

    off = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(blocks, [1, 2], 0, 2)
    assert off.num_cached_blocks == 0 and off.get_cached_block(1) is None


def test_uncache_block() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=True)
    (block,) = pool.get_new_blocks(1)
    cache(pool, [block], [9])
    pool.uncache_block(block)
    assert block.block_hash is None and pool.get_cached_block(9) is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(1) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16, True)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0, True)
