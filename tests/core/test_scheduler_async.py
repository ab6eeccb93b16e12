"""Async scheduling: step N+1 is planned before step N's tokens reach the scheduler."""

from __future__ import annotations

from asyncserve.core.request import RequestStatus
from tests.core.fake_runner import (
    assert_all_blocks_back,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
)


def test_next_step_computes_the_token_in_flight() -> None:
    scheduler, runner = make_scheduler()
    request = make_request("a", 6, max_tokens=4)
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    first = runner.execute(prefill)
    assert request.num_output_placeholders == 1 and request.num_output_tokens == 0
    # Planned before the first token is known: it computes that token's position.
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens == {"a": 1}
    assert decode.running_requests[0].num_computed_tokens == 6
    second = runner.execute(decode)
    assert request.num_output_placeholders == 2
    scheduler.update(prefill, first)
    assert request.num_output_placeholders == 1
    assert request.output_token_ids == first.sampled_token_ids["a"]
    scheduler.update(decode, second)
    assert request.num_output_placeholders == 0
    assert request.output_token_ids == expected_output(request)[:2]


def test_length_limits_count_tokens_in_flight() -> None:
    # max_tokens: the step that would compute past it is never planned.
    scheduler, runner = make_scheduler()
    short = make_request("short", 5, max_tokens=2)
    scheduler.add_request(short)
    plans, finished = run_until_done(scheduler, runner, async_scheduling=True)
    assert [p.num_scheduled_tokens for p in plans if p.num_scheduled_tokens] == [
        {"short": 5},
        {"short": 1},
    ]
    assert finished == [short] and short.status == RequestStatus.FINISHED_LENGTH
    assert short.output_token_ids == expected_output(short)
    # max_model_len likewise (run_until_done checks every plan against both limits).
    scheduler, runner = make_scheduler(max_model_len=12)
    long = make_request("long", 9, max_tokens=100)
    scheduler.add_request(long)
    run_until_done(scheduler, runner, async_scheduling=True)
    assert long.num_tokens == 12 and long.status == RequestStatus.FINISHED_LENGTH
    assert long.output_token_ids == expected_output(long, max_model_len=12)
    assert_all_blocks_back(scheduler)


def test_eos_in_flight_drops_the_extra_token() -> None:
    scheduler, runner = make_scheduler()
    probe = make_request("probe", 7, max_tokens=6)
    eos = expected_output(probe)[2]
    request = make_request("a", 7, max_tokens=6, eos=eos)
    scheduler.add_request(request)
    plans, _ = run_until_done(scheduler, runner, async_scheduling=True)
    # The step after the EOS was planned (and computed) before the EOS was known.
    assert sum(1 for p in plans if "a" in p.num_scheduled_tokens) == 4
    assert request.output_token_ids == expected_output(request) == expected_output(probe)[:3]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert_all_blocks_back(scheduler)


def test_request_preempted_with_a_token_in_flight_keeps_it() -> None:
    # Two requests fill the 4-block pool; growing a fifth block preempts the newer one
    # while its last token is still being sampled.
    scheduler, runner = make_scheduler(num_blocks=4)
    a = make_request("a", 7, max_tokens=6)
    b = make_request("b", [50 + k for k in range(7)], max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    in_flight = None
    while True:
        plan = scheduler.schedule()
        check_plan(plan, scheduler)
        if b.num_preemptions:
            break
        result = runner.execute(plan)
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = (plan, result)
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    known = b.num_output_tokens
    assert in_flight is not None
    result = runner.execute(plan)
    scheduler.update(*in_flight)
    # The token computed before the preemption is kept, not lost or recomputed twice.
    assert b.num_output_tokens == known + 1 and b.num_output_placeholders == 0
    scheduler.update(plan, result)
    run_until_done(scheduler, runner, async_scheduling=True)
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert_all_blocks_back(scheduler)


def test_request_preempted_with_its_last_token_in_flight_finishes_from_the_queue() -> None:
    scheduler, runner = make_scheduler(num_blocks=4)
    a = make_request("a", 7, max_tokens=6)
    # b's token in flight when it is preempted is its last one (max_tokens).
    b = make_request("b", [50 + k for k in range(7)], max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans, finished = run_until_done(scheduler, runner, async_scheduling=True)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert b.output_token_ids == expected_output(b)
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished_requests()
    assert_all_blocks_back(scheduler)
