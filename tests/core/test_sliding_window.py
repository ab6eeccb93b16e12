"""Sliding-window KV: blocks behind every layer's window go back to the pool.

The fake runner reads only the window a query sees, so a block handed back too early (or a
wrong hole) fails its KV check, and a wrong token changes the output.
"""

from __future__ import annotations

import pytest

from asyncserve.core.request import RequestStatus
from asyncserve.core.step import StepPlan, StepResult
from tests.core.fake_runner import (
    BS,
    assert_all_blocks_back,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
)

WINDOW = 6
# Keys a query sees span at most this many blocks.
MAX_HELD = -(-(WINDOW - 1) // BS) + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_long_generation_holds_a_window_of_blocks(async_scheduling: bool) -> None:
    scheduler, runner = make_scheduler(num_blocks=16, budget=8, sliding_window=WINDOW)
    # 400 tokens would need 100 blocks without the window; the pool has 16.
    request = make_request("long", 30, max_tokens=370)
    scheduler.add_request(request)
    kv = scheduler.kv_cache_manager
    in_flight: tuple[StepPlan, StepResult] | None = None
    most_held = 0
    while scheduler.has_unfinished_requests() or in_flight:
        plan = scheduler.schedule()
        check_plan(plan, scheduler)
        held = kv.num_held_blocks("long")
        if plan.num_scheduled_tokens.get("long", 0) == 1:
            most_held = max(most_held, held)
            assert held <= MAX_HELD
        # A prefill chunk holds its own blocks plus the window behind its first token.
        assert held <= MAX_HELD + -(-8 // BS)
        done: tuple[StepPlan, StepResult] | None = (plan, runner.execute(plan))
        if async_scheduling:
            done, in_flight = in_flight, done if plan.num_scheduled_tokens else None
        if done is not None:
            scheduler.update(*done)
    assert most_held >= MAX_HELD - 1
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == expected_output(request)
    assert_all_blocks_back(scheduler)


def test_prefix_hit_takes_only_the_blocks_inside_the_window() -> None:
    scheduler, runner = make_scheduler(num_blocks=32, budget=64, sliding_window=WINDOW)
    prefix = list(range(100, 124))  # six full blocks
    first = make_request("first", prefix + [1], max_tokens=2)
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    # Freed blocks keep their hashes: the whole prefix is still a hit.
    second = make_request("second", prefix + [2, 3], max_tokens=4)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 24
    # The first query (position 24) sees 19..24: blocks 0-3 are holes (block 0 in the table).
    assert scheduler.kv_cache_manager.num_held_blocks("second") == 3
    assert new.block_ids[:4] == [0, 0, 0, 0]
    scheduler.update(plan, runner.execute(plan))
    run_until_done(scheduler, runner)
    assert second.output_token_ids == expected_output(second)
    assert scheduler.prefix_cache_hits == 24
    assert_all_blocks_back(scheduler)


def test_a_long_request_is_not_failed_for_tokens_the_window_dropped() -> None:
    # 200 tokens need 50 blocks without the window; this pool has 10.
    scheduler, runner = make_scheduler(num_blocks=10, budget=8, sliding_window=WINDOW)
    request = make_request("r", 120, max_tokens=80)
    scheduler.add_request(request)
    _, finished = run_until_done(scheduler, runner)
    assert finished == [request] and request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == expected_output(request)
    assert_all_blocks_back(scheduler)
