"""Scheduler: stop conditions, requests too big for the pool, aborts."""

from __future__ import annotations

import pytest

from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import StepResult
from tests.core.fake_runner import (
    assert_all_blocks_back,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)

# ------------------------------------------------------------------------- stop conditions


def stop_case(
    tokens: list[list[int]],
    max_model_len: int = 1024,
    extra_eos: frozenset[int] = frozenset(),
    **kwargs: object,
) -> Request:
    """Run one 3-token prompt on scripted sampled tokens, one list per step."""
    scheduler, _ = make_scheduler(max_model_len=max_model_len)
    request = make_request("r", 3, **kwargs)  # type: ignore[arg-type]
    # What the engine adds from the model's generation config (unless ignore_eos).
    if not request.sampling_params.ignore_eos:
        request.sampling_params.all_stop_token_ids |= extra_eos
    scheduler.add_request(request)
    for sampled in tokens:
        if request.is_finished:
            break
        plan = scheduler.schedule()
        assert "r" in plan.num_scheduled_tokens
        scheduler.update(plan, StepResult(sampled_token_ids={"r": sampled}))
    if request.is_finished:
        assert not scheduler.has_unfinished_requests()
        assert_all_blocks_back(scheduler)
    return request


def test_eos_stops_with_no_stop_reason() -> None:
    r = stop_case([[5], [2]], eos=2)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [5, 2]


def test_ignore_eos_keeps_going() -> None:
    r = stop_case([[2], [2]], eos=2, ignore_eos=True)
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == [2, 2]
    # Generation-config EOS ids obey ignore_eos too; explicit stop ids do not.
    r = stop_case([[9], [8]], extra_eos=frozenset({9}), ignore_eos=True, stop_token_ids=[8])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 8
    r = stop_case([[5], [9]], extra_eos=frozenset({9}))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_stop_token_ids_report_the_token() -> None:
    r = stop_case([[4], [7], [1]], stop_token_ids=[7])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    assert r.output_token_ids == [4, 7]


def test_min_tokens_defers_stop_tokens() -> None:
    r = stop_case([[2], [7], [2]], eos=2, stop_token_ids=[7], min_tokens=3)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [2, 7, 2]


def test_max_tokens_and_max_model_len_finish_with_length() -> None:
    r = stop_case([[1], [1], [1]], max_tokens=3)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [1, 1, 1]
    # A stop token on the last allowed token is reported as a stop.
    r = stop_case([[1], [7]], max_tokens=2, stop_token_ids=[7])
    assert r.status == RequestStatus.FINISHED_STOPPED
    # Prompt of 3 with max_model_len 5: two outputs at most, before max_tokens.
    r = stop_case([[1], [1]], max_model_len=5, max_tokens=8)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 5


def test_tokens_after_a_stop_in_one_step_are_dropped() -> None:
    r = stop_case([[4, 7, 6]], stop_token_ids=[7])
    assert r.output_token_ids == [4, 7] and r.stop_reason == 7


# ------------------------------------------------------------------- errors and aborts


def test_request_too_big_for_the_pool_errors_alone() -> None:
    scheduler, runner = make_scheduler(num_blocks=4)  # 16 token slots
    big = make_request("big", 17)
    small = make_request("small", [5] * 3, max_tokens=3)
    scheduler.add_request(big)
    scheduler.add_request(small)
    plan = scheduler.schedule()
    (errored,) = scheduler.take_errored()
    assert errored is big and big.status == RequestStatus.FINISHED_ERROR
    assert big.error is not None and "4 blocks" in big.error
    assert scheduler.take_errored() == []
    assert list(plan.num_scheduled_tokens) == ["small"] and "big" in plan.freed_request_ids
    scheduler.update(plan, runner.execute(plan))
    run_until_done(scheduler, runner)
    assert small.output_token_ids == expected_output(small)
    assert_all_blocks_back(scheduler)


def test_request_outgrowing_the_pool_errors_with_its_partial_output() -> None:
    scheduler, runner = make_scheduler(num_blocks=4)
    grower = make_request("grower", 14, max_tokens=10)
    scheduler.add_request(grower)
    _, finished = run_until_done(scheduler, runner)
    assert finished == [grower] and grower.status == RequestStatus.FINISHED_ERROR
    # Positions 14 and 15 fit; the token at 16 would need a fifth block.
    assert grower.output_token_ids == expected_output(grower)[:3]
    assert scheduler.num_preemptions_total == 0
    assert_all_blocks_back(scheduler)


def test_finish_requests_from_waiting_and_running() -> None:
    scheduler, runner = make_scheduler(budget=8, max_seqs=1)
    a = make_request("a", 6, max_tokens=4)
    b = make_request("b", [3] * 6)
    c = make_request("c", [4] * 6)
    for r in (a, b, c):
        scheduler.add_request(r)
    step(scheduler, runner)
    assert scheduler.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == [b]
    assert scheduler.num_waiting == 1 and b.status == RequestStatus.FINISHED_ABORTED
    # Abort between schedule and update: the update ignores it, the next plan frees it.
    plan = scheduler.schedule()
    assert list(plan.num_scheduled_tokens) == ["a"] and plan.freed_request_ids == {"b"}
    assert scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED) == [a]
    assert scheduler.update(plan, runner.execute(plan)) == []
    assert a.num_output_tokens == 1
    assert scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED) == []
    plan, _ = step(scheduler, runner)
    assert plan.freed_request_ids == {"a"}
    assert [n.request_id for n in plan.new_requests] == ["c"]
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("c", RequestStatus.RUNNING)
    run_until_done(scheduler, runner)
    assert_all_blocks_back(scheduler)


def test_duplicate_request_id_is_refused() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add_request(make_request("x", 3))


def test_a_request_read_at_its_end_is_returned_only_when_it_ends() -> None:
    scheduler, runner = make_scheduler()
    late = make_request("late", 3, max_tokens=3)
    late.tokens_read_at_end = True
    scheduler.add_request(late)
    scheduler.add_request(make_request("each", 3, max_tokens=3))
    returned = []
    while scheduler.has_unfinished_requests():
        returned.append(sorted(r.request_id for r in step(scheduler, runner)[1]))
    assert returned == [["each"], ["each"], ["each", "late"]]
    assert len(late.output_token_ids) == 3
