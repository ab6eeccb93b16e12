"""Pipeline parallelism: up to P steps in flight, each with requests the others do not hold.

The fake runner stands for the last stage (it samples, so it holds every token at once);
`FirstStage` stands for the stages before it, which learn the sampled tokens only from the
plans (RunningRequestData.new_token_ids) and must see the same tokens as the last stage
whenever a request is scheduled.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.scheduler import Scheduler
from asyncserve.core.step import StepPlan, StepResult
from tests.core.fake_runner import (
    VOCAB,
    FakeRunner,
    assert_all_blocks_back,
    check_length_limits,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
)


class FirstStage:
    """The output tokens a stage that does not sample knows: only what plans carry."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan, last_stage: FakeRunner) -> None:
        for rid in plan.freed_request_ids:
            self.outputs.pop(rid, None)
        for new in plan.new_requests:
            self.outputs[new.request_id] = list(new.output_token_ids)
        for running in plan.running_requests:
            assert running.new_token_ids is not None
            tokens = self.outputs[running.request_id]
            assert running.new_tokens_from == len(tokens)  # nothing sent twice, none skipped
            tokens.extend(running.new_token_ids)
            assert tokens == last_stage.states[running.request_id].output_token_ids


class Pipeline:
    """Steps the scheduler with up to `depth` steps in flight, as the step loop does."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner, depth: int) -> None:
        self.scheduler, self.runner, self.depth = scheduler, runner, depth
        self.first = FirstStage()
        self.in_flight: deque[tuple[StepPlan, StepResult]] = deque()
        self.max_in_flight = 0
        self.plans: list[StepPlan] = []

    def step(self) -> list[Request]:
        """Launch a step if one fits and has work, else take the oldest one back; returns
        the requests that got tokens."""
        if len(self.in_flight) < self.depth:
            plan = self.scheduler.schedule()
            check_plan(plan, self.scheduler)
            check_length_limits(plan, self.scheduler)
            if plan.num_scheduled_tokens or plan.freed_request_ids:
                held = {rid for p, _ in self.in_flight for rid in p.num_scheduled_tokens}
                assert not held & set(plan.num_scheduled_tokens), "a request in two steps"
                self.first.apply(plan, self.runner)
                self.in_flight.append((plan, self.runner.execute(plan)))
                self.plans.append(plan)
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
                if len(self.in_flight) < self.depth:
                    return []
        if not self.in_flight:
            return []
        return self.scheduler.update(*self.in_flight.popleft())

    def busy(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_unfinished_requests()


def test_steps_in_flight_share_the_requests() -> None:
    scheduler, runner = make_scheduler(max_concurrent_batches=2)
    requests = [make_request(f"r{i}", 3 + i, max_tokens=6) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    pipe = Pipeline(scheduler, runner, depth=2)
    for _ in range(200):
        if not pipe.busy():
            break
        pipe.step()
    assert not pipe.busy()
    # Each of the first two steps takes half of the requests; both are in flight at once.
    first, second = pipe.plans[:2]
    assert list(first.num_scheduled_tokens) == [f"r{i}" for i in range(4)]
    assert list(second.num_scheduled_tokens) == [f"r{i}" for i in range(4, 8)]
    assert pipe.max_in_flight == 2
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == expected_output(request)
    assert_all_blocks_back(scheduler)


@pytest.mark.parametrize("depth", [2, 3])
def test_random_mix_in_flight(depth: int) -> None:
    """Random arrivals, aborts (of requests in flight too), EOS, preemption and prefix hits
    with `depth` steps in flight: every request gets exactly its own tokens, the stages
    that do not sample see them, and the pool takes every block back."""
    rng = random.Random(99)
    scheduler, runner = make_scheduler(
        num_blocks=24, budget=24, max_seqs=6, max_concurrent_batches=depth
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    pending: list[Request] = []
    for i in range(150):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + prompt[:10]
        eos = rng.randrange(VOCAB) if rng.random() < 0.3 else None
        pending.append(make_request(f"r{i}", prompt, rng.randint(1, 24), 0, float(i), eos))
    all_requests = list(pending)
    pipe = Pipeline(scheduler, runner, depth)
    for _ in range(10_000):
        if not (pending or pipe.busy()):
            break
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        live = [r.request_id for r in all_requests if scheduler.get_request(r.request_id)]
        if live and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(live)], RequestStatus.FINISHED_ABORTED)
        pipe.step()
    assert not pending and not pipe.busy()
    assert pipe.max_in_flight == depth
    assert scheduler.num_preemptions_total > 0 and scheduler.prefix_cache_hits > 0
    statuses = {r.status for r in all_requests}
    assert RequestStatus.FINISHED_ABORTED in statuses and RequestStatus.FINISHED_LENGTH in statuses
    for request in all_requests:
        assert request.is_finished
        expected = expected_output(request)
        assert request.output_token_ids == expected[: request.num_output_tokens]
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected
    assert_all_blocks_back(scheduler)
    assert scheduler.micro_batches._in_flight == {} and scheduler.micro_batches._sent == {}
