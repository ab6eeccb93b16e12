"""Replica choice: least outstanding tokens, first-block affinity unless that replica is
much more loaded, dead replicas skipped; and the merged per-replica /metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncserve.engine.dp_balancer import ReplicaBalancer
from asyncserve.engine.dp_metrics import DataParallelMetrics
from asyncserve.metrics import EngineMetrics

BLOCK = 4


def test_least_outstanding_tokens_and_release() -> None:
    b = ReplicaBalancer(3, BLOCK)
    assert b.choose([1, 2], 100) == 0
    assert b.choose([3, 4], 10) == 1
    assert b.choose([5, 6], 10) == 2
    # Replica 1 and 2 carry 10 each: the next goes round to the first of them.
    assert b.choose([7, 8], 5) == 1
    assert b.load == [100, 15, 10]
    b.release(0, 100)
    assert b.choose([9, 9], 1) == 0
    b.release(1, 1000)  # never below zero
    assert b.load[1] == 0


def test_ties_go_round_the_replicas() -> None:
    b = ReplicaBalancer(2, BLOCK)
    chosen = []
    for _ in range(4):
        index = b.choose([1], 10)
        chosen.append(index)
        b.release(index, 10)
    assert chosen == [0, 1, 0, 1]


def test_shared_prefix_sticks_to_its_replica_while_the_hit_is_worth_it() -> None:
    b = ReplicaBalancer(2, BLOCK, affinity_per_token=2.0)
    history = list(range(100, 140))  # 10 blocks of a conversation
    first = b.choose(history + [1], 50)
    other = 1 - first
    # Same 10 blocks: the same replica while it carries at most 2 x 40 tokens more.
    assert b.choose(history + [2], 30) == first  # 80 more than the idle one: still in
    assert b.choose(history + [3], 1) == other  # 81 more: the least loaded takes it
    # Only the first block shared: 2 x 4 tokens of slack, so the least loaded replica wins.
    b.release(first, 80)
    b.release(other, 1)
    assert b.choose(history[:4] + [9] * 8, 20) == first  # first owns block 1; loads equal
    assert b.choose(history[:4] + [8] * 8, 20) == other  # 20 > 8: balance wins
    # The longest owned prefix decides: block 2 onwards of this one belongs to `other`.
    shorter = history[:4] + [8] * 8 + [7]
    assert b.choose(shorter, 1) == other


def test_image_hashes_are_part_of_the_prefix() -> None:
    """The same placeholder tokens with other images share no KV: no affinity for them."""
    from asyncserve.multimodal.inputs import MultiModalFeatures, MultiModalItem

    def features(image_hash: str) -> MultiModalFeatures:
        item = MultiModalItem("image", {}, offset=2, length=8, hash=image_hash)
        return MultiModalFeatures([item])

    b = ReplicaBalancer(2, BLOCK, affinity_per_token=2.0)
    prompt = [1, 2] + [99] * 8 + [3, 4, 5, 6]  # 3 blocks; the image spans blocks 1 to 3
    first = b.choose(prompt, 10, extra_keys=features("a" * 64).block_extra_keys)
    # The same image: the replica that holds its blocks.
    assert b.choose(prompt, 10, extra_keys=features("a" * 64).block_extra_keys) == first
    # Another image at the same placeholders: least loaded (the other replica).
    assert b.choose(prompt, 1, extra_keys=features("b" * 64).block_extra_keys) == 1 - first
    # Without images the same tokens chain to other hashes than with either image.
    chains = {
        tuple(b._prefix_hashes(prompt)),
        tuple(b._prefix_hashes(prompt, 0, features("a" * 64).block_extra_keys)),
        tuple(b._prefix_hashes(prompt, 0, features("b" * 64).block_extra_keys)),
    }
    assert len(chains) == 3


def test_prompts_shorter_than_a_block_carry_no_affinity() -> None:
    b = ReplicaBalancer(2, BLOCK)
    short = [1, 2, 3]
    assert [b.choose(short, 10) for _ in range(4)] == [0, 1, 0, 1]


def test_dead_replicas_are_skipped() -> None:
    b = ReplicaBalancer(2, BLOCK)
    shared = [1, 2, 3, 4]
    owner = b.choose(shared, 5)
    b.mark_dead(owner)
    assert all(b.choose(shared, 5) == 1 - owner for _ in range(3))
    b.mark_dead(1 - owner)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        b.choose(shared, 5)


def test_metrics_label_each_replica_and_total() -> None:
    replicas = [EngineMetrics("smol") for _ in range(2)]
    replicas[0].on_step(num_running=3, num_waiting=1, kv_cache_usage=0.5)
    replicas[1].on_step(num_running=2, num_waiting=0, kv_cache_usage=0.25)
    replicas[0].on_tokens(prompt_tokens=10, generation_tokens=4)
    replicas[1].on_tokens(prompt_tokens=6, generation_tokens=2)
    replicas[1].on_first_token(0.03)

    class Snapshots:
        async def metrics_snapshots(self) -> dict[int, list[object]]:
            return {i: list(m.registry.collect()) for i, m in enumerate(replicas)}

    merged = DataParallelMetrics()
    asyncio.run(merged.refresh(Snapshots()))
    body, _ = merged.render()
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            values[(s.name, s.labels["engine"])] = s.value
    assert values[("asyncserve:num_requests_running", "0")] == 3
    assert values[("asyncserve:num_requests_running", "1")] == 2
    assert values[("asyncserve:num_requests_running", "total")] == 5
    assert values[("asyncserve:kv_cache_usage_perc", "total")] == 0.375
    assert values[("asyncserve:prompt_tokens_total", "total")] == 16
    assert values[("asyncserve:generation_tokens_total", "1")] == 2
    assert values[("asyncserve:time_to_first_token_seconds_count", "total")] == 1


def test_adapter_affinity_and_prefixes_per_adapter() -> None:
    balancer = ReplicaBalancer(2, block_size=4, lora_affinity_tokens=100)
    prompt = list(range(16))
    first = balancer.choose(prompt, 10, lora_int_id=7)
    # Same adapter, no shared prefix: stays on the replica holding the adapter's weights.
    assert balancer.choose([99, 98], 10, lora_int_id=7) == first
    # The same prompt with another adapter shares no KV: the less loaded replica takes it.
    assert balancer.choose(prompt, 10, lora_int_id=8) == 1 - first
    # Too much more loaded: the adapter moves.
    balancer.load[first] += 500
    assert balancer.choose([5], 10, lora_int_id=7) == 1 - first
