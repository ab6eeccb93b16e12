"""The scheduler with LoRA: no step mixes more than max_loras adapters (base rows do not
count), and prefix-cache blocks are keyed by adapter."""

from __future__ import annotations

from asyncserve.config import CacheConfig, SchedulerConfig
from asyncserve.core.block_pool import hash_block
from asyncserve.core.request import RequestStatus
from asyncserve.core.scheduler import Scheduler
from asyncserve.lora.request import LoRARequest
from asyncserve.metrics import EngineMetrics
from tests.core.fake_runner import (
    BS,
    FakeRunner,
    assert_all_blocks_back,
    make_request,
    run_until_done,
    step,
)


def _scheduler(max_loras: int) -> tuple[Scheduler, FakeRunner]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=BS),
        num_blocks=64,
        max_model_len=1024,
        max_loras=max_loras,
    )
    return scheduler, FakeRunner(64, BS)


def test_steps_hold_at_most_max_loras_adapters() -> None:
    scheduler, runner = _scheduler(max_loras=2)
    loras = [LoRARequest(f"l{i}", i, "/adapters") for i in (1, 2, 3)]
    requests = []
    for i in range(12):
        request = make_request(f"r{i}", 5 + i, max_tokens=3)
        request.lora_request = loras[i % 4] if i % 4 < 3 else None
        requests.append(request)
        scheduler.add_request(request)
    plans, finished = run_until_done(scheduler, runner)
    by_id = {r.request_id: r for r in requests}
    counts = [len({by_id[rid].lora_int_id for rid in p.num_scheduled_tokens} - {0}) for p in plans]
    assert max(counts) == 2
    assert len(finished) == 12 and all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    new = [n for p in plans for n in p.new_requests]
    assert {n.request_id: n.lora_request for n in new} == {
        r.request_id: r.lora_request for r in requests
    }
    assert_all_blocks_back(scheduler)


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    tokens = tuple(range(BS))
    assert hash_block(None, tokens) == hash_block(None, tokens, 0)
    assert len({hash_block(None, tokens, i) for i in (0, 1, 2)}) == 3
    scheduler, runner = _scheduler(max_loras=2)
    first = make_request("a", 3 * BS + 1, max_tokens=1)
    first.lora_request = LoRARequest("l1", 1, "/adapters")
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    other = make_request("b", 3 * BS + 1, max_tokens=1)
    other.lora_request = LoRARequest("l2", 2, "/adapters")
    assert scheduler.kv_cache_manager.get_computed_blocks(other) == ([], 0)
    same = make_request("c", 3 * BS + 1, max_tokens=1)
    same.lora_request = LoRARequest("l1", 1, "/adapters")
    assert scheduler.kv_cache_manager.get_computed_blocks(same)[1] == 3 * BS


def test_a_request_over_the_adapter_limit_lets_others_pass() -> None:
    scheduler, runner = _scheduler(max_loras=1)
    first = make_request("a", 6, max_tokens=4)
    first.lora_request = LoRARequest("l1", 1, "/adapters")
    blocked = make_request("b", 6, max_tokens=4)
    blocked.lora_request = LoRARequest("l2", 2, "/adapters")
    base = make_request("c", 6, max_tokens=4)
    same = make_request("d", 6, max_tokens=4)
    same.lora_request = LoRARequest("l1", 1, "/adapters")
    for request in (first, blocked, base, same):
        scheduler.add_request(request)
    plan, _ = step(scheduler, runner)
    assert list(plan.num_scheduled_tokens) == ["a", "c", "d"]
    assert scheduler.num_waiting == 1
    assert scheduler.lora_names() == (["l1"], ["l2"])
    metrics = EngineMetrics("m")
    metrics.on_lora(1, *scheduler.lora_names())
    text = metrics.render()[0].decode()
    assert (
        'lora_requests_info{max_lora="1",running_lora_adapters="l1",waiting_lora_adapters="l2"}'
        in text
    )
    plans, finished = run_until_done(scheduler, runner)
    # b runs once l1's requests are done, never beside them.
    for p in plans:
        if "b" in p.num_scheduled_tokens:
            assert not {"a", "d"} & set(p.num_scheduled_tokens)
    assert {r.request_id for r in finished} >= {"b"}
    assert_all_blocks_back(scheduler)
