from __future__ import annotations

import random

import pytest

from asyncserve.config import SchedulingPolicy
from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import StepPlan, StepResult
from tests.core.fake_runner import (
    BS,
    VOCAB,
    assert_all_blocks_back,
    check_length_limits,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)

# --------------------------------------------------------------------------- budget, order


def test_budget_and_max_num_seqs_hold_every_step() -> None:
    scheduler, runner = make_scheduler(budget=16, max_seqs=4)
    rng = random.Random(1)
    requests = [
        make_request(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 6)) for i in range(20)
    ]
    for r in requests:
        scheduler.add_request(r)
    plans, finished = run_until_done(scheduler, runner)
    assert max(len(p.num_scheduled_tokens) for p in plans) == 4
    assert max(p.total_num_scheduled_tokens for p in plans) == 16
    assert len(finished) == 20
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r)
    assert_all_blocks_back(scheduler)


def test_running_requests_come_before_new_ones() -> None:
    scheduler, runner = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", [7] * 10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan, _ = step(scheduler, runner)
    # a takes its whole prompt, b a 6-token chunk of its prompt.
    assert plan.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [r.request_id for r in plan.new_requests] == ["a", "b"]
    assert [r.num_computed_tokens for r in plan.new_requests] == [0, 0]

    scheduler.add_request(make_request("c", 3))
    plan, _ = step(scheduler, runner)
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 4), ("c", 3)]
    assert [r.request_id for r in plan.running_requests] == ["a", "b"]
    assert [r.num_computed_tokens for r in plan.running_requests] == [10, 6]
    assert [r.request_id for r in plan.new_requests] == ["c"]


def test_chunked_prefill_mixes_with_decodes() -> None:
    scheduler, runner = make_scheduler(budget=8)
    short = make_request("short", 4, max_tokens=20)
    scheduler.add_request(short)
    step(scheduler, runner)
    long = make_request("long", list(range(200, 240)), max_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan, updated = step(scheduler, runner)
        assert plan.num_scheduled_tokens["short"] == 1  # the decode is never starved
        chunks.append(plan.num_scheduled_tokens["long"])
        assert (long in updated) == (sum(chunks) == 40)
    assert chunks == [7, 7, 7, 7, 7, 5]
    assert short.num_output_tokens == 7
    run_until_done(scheduler, runner)
    assert long.output_token_ids == expected_output(long)
    assert short.output_token_ids == expected_output(short)


def test_priority_orders_admission() -> None:
    specs = [("p3", 3, 0.0), ("p1", 1, 1.0), ("p2", 2, 2.0), ("p1-late", 1, 3.0)]
    for policy, expected in (
        ("priority", ["p1", "p1-late", "p2", "p3"]),
        ("fcfs", ["p3", "p1", "p2", "p1-late"]),
    ):
        scheduler, runner = make_scheduler(max_seqs=1, policy=policy)  # type: ignore[arg-type]
        for rid, prio, arrival in specs:
            scheduler.add_request(
                make_request(rid, 5, max_tokens=2, priority=prio, arrival=arrival)
            )
        _, finished = run_until_done(scheduler, runner)
        assert [r.request_id for r in finished] == expected


# ------------------------------------------------------------------------------ preemption


def test_preemption_fcfs_takes_the_newest_and_admits_nothing() -> None:
    # 6 blocks: three 7-token prompts fill the pool; the first block-boundary crossing
    # must preempt the newest running request.
    scheduler, runner = make_scheduler(num_blocks=6)
    reqs = [
        make_request(name, [i * 10 + k for k in range(7)], max_tokens=10)
        for i, name in enumerate("abc")
    ]
    for r in reqs:
        scheduler.add_request(r)
    late = make_request("late", 1)
    step(scheduler, runner)
    scheduler.add_request(late)
    while scheduler.num_preemptions_total == 0:
        plan, _ = step(scheduler, runner)
    a, b, c = reqs
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert "c" in plan.freed_request_ids
    assert list(plan.num_scheduled_tokens) == ["a", "b"]
    assert plan.new_requests == [] and late.status == RequestStatus.WAITING
    assert scheduler.num_waiting == 2

    # c resumes ahead of "late", in full, with the outputs it had.
    outputs_before = list(c.output_token_ids)
    while c.status != RequestStatus.RUNNING:
        plan, _ = step(scheduler, runner)
    (resumed,) = [n for n in plan.new_requests if n.request_id == "c"]
    assert resumed.output_token_ids == outputs_before
    assert len(resumed.block_ids) * BS >= c.num_computed_tokens
    run_until_done(scheduler, runner)
    for r in [*reqs, late]:
        assert r.output_token_ids == expected_output(r)
    assert_all_blocks_back(scheduler)


def test_preemption_fcfs_of_itself() -> None:
    scheduler, runner = make_scheduler(num_blocks=2)
    a = make_request("a", 2, max_tokens=6)
    b = make_request("b", [9, 9, 9, 9], max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)  # one block each
    # b (the newest) needs a second block for position 4 and is its own victim.
    plan, _ = step(scheduler, runner)
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert list(plan.num_scheduled_tokens) == ["a"] and "b" in plan.freed_request_ids
    run_until_done(scheduler, runner)
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert_all_blocks_back(scheduler)


def test_preemption_priority_takes_the_worst_even_if_already_scheduled() -> None:
    scheduler, runner = make_scheduler(num_blocks=6, policy="priority")
    low = make_request("low", 5, max_tokens=8, priority=5, arrival=0.0)
    scheduler.add_request(low)
    step(scheduler, runner)  # low runs alone: 2 blocks
    hi = make_request("hi", [50 + k for k in range(8)], max_tokens=8, priority=0, arrival=1.0)
    mid = make_request("mid", [80 + k for k in range(8)], max_tokens=8, priority=1, arrival=2.0)
    scheduler.add_request(mid)
    scheduler.add_request(hi)
    plan, _ = step(scheduler, runner)  # hi, mid admitted by priority; the pool is full
    assert [n.request_id for n in plan.new_requests] == ["hi", "mid"]
    # low (first in running order, so already scheduled) is preempted when hi needs a block.
    plan, _ = step(scheduler, runner)
    assert low.status == RequestStatus.PREEMPTED and low.num_preemptions == 1
    assert list(plan.num_scheduled_tokens) == ["hi", "mid"]
    assert plan.total_num_scheduled_tokens == 2
    assert "low" in plan.freed_request_ids
    assert [r.request_id for r in plan.running_requests] == ["hi", "mid"]
    run_until_done(scheduler, runner)
    for r in (low, hi, mid):
        assert r.output_token_ids == expected_output(r)
    assert_all_blocks_back(scheduler)


def test_preempted_request_reuses_its_own_cached_blocks() -> None:
    scheduler, runner = make_scheduler(num_blocks=8)
    a = make_request("a", [1] * 15, max_tokens=10)
    b = make_request("b", [2] * 15, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    while b.num_preemptions == 0:
        step(scheduler, runner)
    while b.status != RequestStatus.RUNNING:
        plan, _ = step(scheduler, runner)
    (resumed,) = plan.new_requests
    # Its full blocks stayed cached while it waited, so the recompute starts past them.
    assert resumed.num_computed_tokens > 0
    assert b.num_cached_tokens == 0  # recorded at first scheduling only
    run_until_done(scheduler, runner)
    assert b.output_token_ids == expected_output(b)


# ---------------------------------------------------------------------------- prefix cache


def test_prefix_cache_hits_across_and_within_steps() -> None:
    scheduler, runner = make_scheduler()
    prefix = list(range(100, 112))  # three full blocks
    first = make_request("first", prefix + [1])
    scheduler.add_request(first)
    plan, _ = step(scheduler, runner)
    first_blocks = plan.new_requests[0].block_ids
    run_until_done(scheduler, runner)

    second = make_request("second", prefix + [2, 3])
    exact = make_request("exact", prefix)
    scheduler.add_request(second)
    scheduler.add_request(exact)
    plan, _ = step(scheduler, runner)
    by_id = {n.request_id: n for n in plan.new_requests}
    assert by_id["second"].num_computed_tokens == 12
    assert by_id["second"].block_ids[:3] == first_blocks[:3]
    assert plan.num_scheduled_tokens["second"] == 2
    # A prompt that is all prefix still computes its last token: the hit stops a block short.
    assert by_id["exact"].num_computed_tokens == 8
    assert second.num_cached_tokens == 12 and exact.num_cached_tokens == 8
    assert scheduler.prefix_cache_queries == 13 + 14 + 12
    assert scheduler.prefix_cache_hits == 12 + 8

    # Two requests with a new shared prefix in one step: the second reads blocks the first
    # is computing in the same forward pass.
    x = make_request("x", list(range(500, 513)))
    y = make_request("y", list(range(500, 512)) + [7])
    scheduler.add_request(x)
    scheduler.add_request(y)
    plan, _ = step(scheduler, runner)
    assert {n.request_id: n.num_computed_tokens for n in plan.new_requests} == {"x": 0, "y": 12}
    run_until_done(scheduler, runner)
    for r in (first, second, exact, x, y):
        assert r.output_token_ids == expected_output(r)
    assert_all_blocks_back(scheduler)


def test_prefix_caching_disabled() -> None:
    scheduler, runner = make_scheduler(prefix_caching=False)
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, 13))
        run_until_done(scheduler, runner)
    assert scheduler.prefix_cache_hits == 0 and scheduler.prefix_cache_queries == 0
    assert scheduler.block_pool.num_cached_blocks == 0


# ------------------------------------------------------------------------ block accounting


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_mix_gives_every_block_back(
    policy: SchedulingPolicy, async_scheduling: bool
) -> None:
    """Random arrivals, aborts, EOS, preemption and prefix hits. With async scheduling each
    step is planned before the last one's tokens reach the scheduler (the runner, like the
    device, already holds them)."""
    _random_mix(policy, async_scheduling, None)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_mix_with_a_sliding_window(async_scheduling: bool) -> None:
    """The same mix for a model whose every layer has a 7-token window: blocks behind it
    go back early, prefix hits skip them, and every output is still exact."""
    _random_mix("fcfs", async_scheduling, 7)


def _random_mix(
    policy: SchedulingPolicy, async_scheduling: bool, sliding_window: int | None
) -> None:
    rng = random.Random(1234)
    # A window needs fewer blocks: a smaller pool keeps preemption in the mix.
    scheduler, runner = make_scheduler(
        num_blocks=24 if sliding_window is None else 12,
        budget=24,
        max_seqs=6,
        policy=policy,
        sliding_window=sliding_window,
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    pending: list[Request] = []
    for i in range(200):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + prompt[:10]
        eos = rng.randrange(VOCAB) if rng.random() < 0.3 else None
        prio = rng.randint(0, 3)
        pending.append(make_request(f"r{i}", prompt, rng.randint(1, 24), prio, float(i), eos))
    all_requests = list(pending)
    ended: dict[str, Request] = {}

    def abort_some(request_ids: list[str]) -> None:
        for request in scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            ended[request.request_id] = request

    steps = 0
    in_flight: tuple[StepPlan, StepResult] | None = None
    while pending or scheduler.has_unfinished_requests() or in_flight:
        steps += 1
        assert steps < 5000
        for _ in range(rng.randint(0, 4)):
            if pending:
                scheduler.add_request(pending.pop(0))
        live = [r.request_id for r in all_requests if scheduler.get_request(r.request_id)]
        if live and rng.random() < 0.1:
            abort_some([rng.choice(live)])
        plan = scheduler.schedule()
        check_plan(plan, scheduler)
        check_length_limits(plan, scheduler)
        for request in scheduler.take_errored():
            ended[request.request_id] = request
        result = runner.execute(plan)
        if plan.num_scheduled_tokens and rng.random() < 0.1:
            abort_some([rng.choice(list(plan.num_scheduled_tokens))])
        done: tuple[StepPlan, StepResult] | None = (plan, result)
        if async_scheduling:
            done, in_flight = in_flight, (plan, result) if plan.num_scheduled_tokens else None
        if done is not None:
            for request in scheduler.update(*done):
                if request.is_finished:
                    ended[request.request_id] = request

    assert len(ended) == len(all_requests)
    statuses = {r.status for r in all_requests}
    assert RequestStatus.FINISHED_ABORTED in statuses and RequestStatus.FINISHED_LENGTH in statuses
    assert scheduler.num_preemptions_total > 0 and scheduler.prefix_cache_hits > 0
    for request in all_requests:
        assert request.is_finished
        # Whatever happened on the way, the tokens are those it gets alone.
        expected = expected_output(request)
        assert request.output_token_ids == expected[: request.num_output_tokens]
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected
    assert_all_blocks_back(scheduler)
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert scheduler.reset_prefix_cache() is True
    assert scheduler.block_pool.num_cached_blocks == 0


def test_first_scheduled_time_and_cached_tokens_set_once() -> None:
    scheduler, runner = make_scheduler(num_blocks=6)
    reqs = [make_request(n, [i] * 7, max_tokens=10) for i, n in enumerate("abc")]
    for r in reqs:
        scheduler.add_request(r)
    step(scheduler, runner)
    times = [r.first_scheduled_time for r in reqs]
    assert all(t is not None for t in times)
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 0]
    run_until_done(scheduler, runner)
    assert reqs[2].num_preemptions > 0
    assert [r.first_scheduled_time for r in reqs] == times
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 0]
    assert all(r.first_token_time is not None for r in reqs)
