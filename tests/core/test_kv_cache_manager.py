from __future__ import annotations

from asyncserve.core.block_pool import BlockPool, hash_block
from asyncserve.core.kv_cache_manager import KVCacheManager
from asyncserve.core.request import Request
from asyncserve.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int = 16, prefix_caching: bool = True) -> KVCacheManager:
    pool = BlockPool(num_blocks, BS, prefix_caching)
    return KVCacheManager(pool, BS, prefix_caching)


def make_request(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params))  # type: ignore[arg-type]


def admit(kv: KVCacheManager, request: Request) -> int:
    """Prefix lookup and allocation for the whole prompt, as the scheduler does."""
    hit, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_allocate_grows_by_whole_blocks() -> None:
    kv = make_manager()
    req = make_request("a", list(range(6)))
    ids = kv.allocate_slots(req, 6)
    assert ids is not None and len(ids) == 2
    assert kv.get_block_ids("a") == ids
    req.num_computed_tokens = 6
    # Two more tokens fit in the second block; the ninth needs a third.
    req.output_token_ids += [100, 101]
    assert kv.allocate_slots(req, 2) == []
    req.num_computed_tokens = 8
    req.output_token_ids.append(102)
    new = kv.allocate_slots(req, 1)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("a") == ids + new
    assert kv.num_free_blocks == 13


def test_allocate_takes_nothing_when_short() -> None:
    kv = make_manager(num_blocks=3)
    big = make_request("big", list(range(10)))
    assert kv.allocate_slots(big, 10) is not None
    other = make_request("other", list(range(50, 58)))
    assert kv.allocate_slots(other, 8) is None
    assert kv.get_block_ids("other") == []
    assert kv.num_free_blocks == 0


def test_block_hashes_extend_incrementally() -> None:
    kv = make_manager()
    req = make_request("a", list(range(10)))
    kv.allocate_slots(req, 10)
    assert req.block_hashes == [
        hash_block(None, (0, 1, 2, 3)),
        hash_block(hash_block(None, (0, 1, 2, 3)), (4, 5, 6, 7)),
    ]
    req.num_computed_tokens = 10
    # Outputs complete the third block: its hash chains on and covers prompt + output.
    req.output_token_ids += [20, 21]
    kv.allocate_slots(req, 2)
    assert len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block(req.block_hashes[1], (8, 9, 20, 21))
    assert kv.block_pool.num_cached_blocks == 3


def test_prefix_hit_reuses_blocks_and_is_capped() -> None:
    kv = make_manager()
    prefix = list(range(12))  # three full blocks
    first = make_request("first", prefix + [90, 91])
    assert admit(kv, first) == 0
    first_ids = kv.get_block_ids("first")

    second = make_request("second", prefix + [70])
    assert admit(kv, second) == 12
    assert kv.get_block_ids("second")[:3] == first_ids[:3]
    assert kv.get_block_ids("second")[3] != first_ids[3]
    assert [b.ref_cnt for b in kv.block_pool.blocks if b.block_id in first_ids[:3]] == [2, 2, 2]

    # A prompt of exactly three blocks may reuse only two: the last token must be computed.
    exact = make_request("exact", prefix)
    hit, num_hit = kv.get_computed_blocks(exact)
    assert num_hit == 8 and [b.block_id for b in hit] == first_ids[:2]

    # A one-block prompt reuses nothing.
    short = make_request("short", prefix[:4])
    assert kv.get_computed_blocks(short) == ([], 0)


def test_prefix_hit_on_freed_cached_blocks() -> None:
    kv = make_manager(num_blocks=8)
    first = make_request("first", list(range(13)))
    admit(kv, first)
    ids = kv.get_block_ids("first")
    kv.free(first)
    assert kv.num_free_blocks == 8
    again = make_request("again", list(range(13)))
    hit, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 12 and [b.block_id for b in hit] == ids[:3]
    # Touching free hit blocks counts against the free blocks.
    assert kv.allocate_slots(again, 1, hit) is not None
    assert kv.num_free_blocks == 4


def test_allocation_counts_free_hit_blocks_as_taken() -> None:
    kv = make_manager(num_blocks=4)
    first = make_request("first", list(range(9)))
    admit(kv, first)
    kv.free(first)
    # Only the two full blocks were cached. 2 free hit blocks + 2 new ones fill the pool
    # exactly; 2 hit + 3 new is one too many, though 4 blocks are free before the touch.
    fits = make_request("fits", list(range(12)) + [1, 2, 3, 4])
    hit, num_hit = kv.get_computed_blocks(fits)
    assert num_hit == 8
    too_big = make_request("too_big", list(range(8)) + [0] * 12)
    hit2, num_hit2 = kv.get_computed_blocks(too_big)
    assert num_hit2 == 8
    assert kv.allocate_slots(too_big, 12, hit2) is None
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.allocate_slots(fits, 8, hit) is not None
    assert kv.num_free_blocks == 0


def test_stats_count_tokens_per_recorded_lookup() -> None:
    kv = make_manager()
    a = make_request("a", list(range(9)))
    kv.record_prefix_lookup(a, admit(kv, a))
    b = make_request("b", list(range(9)))
    kv.record_prefix_lookup(b, admit(kv, b))
    assert kv.prefix_cache_queries == 18
    assert kv.prefix_cache_hits == 8


def test_prompt_logprobs_and_disabled_cache_skip_lookup() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)

    off = make_manager(prefix_caching=False)
    req = make_request("a", list(range(9)))
    admit(off, req)
    assert req.block_hashes == [] and off.block_pool.num_cached_blocks == 0
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    off.record_prefix_lookup(req, 0)
    assert off.prefix_cache_queries == 0


def test_free_returns_everything_tail_first() -> None:
    kv = make_manager(num_blocks=6)
    req = make_request("a", list(range(12)))
    admit(kv, req)
    ids = kv.get_block_ids("a")
    kv.free(req)
    assert kv.num_free_blocks == 6 and kv.get_block_ids("a") == []
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    # Fresh blocks first, then the cached ones from the request's tail.
    taken = [b.block_id for b in kv.block_pool.get_new_blocks(6)]
    assert taken[3:] == ids[::-1]
    # Freeing an unknown request is a no-op.
    kv.free(make_request("ghost", [1]))


def test_free_drops_hashes_of_blocks_never_computed() -> None:
    kv = make_manager()
    req = make_request("a", list(range(12)))
    # Allocated for the whole prompt (so hashed), but preempted before the step ran.
    assert kv.allocate_slots(req, 12) is not None
    req.num_computed_tokens = 4
    kv.free(req)
    pool = kv.block_pool
    assert pool.get_cached_block(req.block_hashes[0]) is not None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[2]) is None
    again = make_request("b", list(range(12)) + [5])
    assert kv.get_computed_blocks(again)[1] == 4
