"""The decode-latency cap: step times fitted per token, and the prefill tokens a step may
take while streams decode. Step times come from a simulated device, no clock is read."""

from __future__ import annotations

import pytest

from asyncserve.core.step_time import StepTimeModel
from tests.core.fake_runner import (
    BS,
    assert_all_blocks_back,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
)


def device_seconds(num_tokens: int, overhead: float = 0.01, per_token: float = 0.001) -> float:
    return overhead + per_token * num_tokens


def test_fit_separates_overhead_from_per_token_cost() -> None:
    model = StepTimeModel()
    assert model.fit() is None and model.prefill_budget(3, 0.1, 16) is None
    for n in (1, 64, 2, 128, 3, 32, 1, 256):
        model.observe(n, device_seconds(n))
    overhead, per_token = model.fit()  # type: ignore[misc]
    assert overhead == pytest.approx(0.01, rel=1e-6)
    assert per_token == pytest.approx(0.001, rel=1e-6)
    # 100 ms with 10 decodes: (0.1 - 0.01) / 0.001 - 10 = 80 prefill tokens.
    assert model.prefill_budget(10, 0.1, 16) == 80
    # Never below the minimum, however slow the device.
    assert model.prefill_budget(10, 0.001, 16) == 16


def test_budget_grows_at_most_twice_past_the_largest_step() -> None:
    model = StepTimeModel()
    for n in (1, 4, 1, 1):
        model.observe(n, device_seconds(n))
    # The fit says 89 tokens fit in 100 ms; only steps of 4 tokens were measured.
    assert model.prefill_budget(1, 0.1, 2) == 7  # 2 x 4, less the decode
    model.observe(8, device_seconds(8))
    assert model.prefill_budget(1, 0.1, 2) == 15


def test_decode_only_samples_charge_everything_to_the_tokens() -> None:
    model = StepTimeModel()
    for _ in range(5):
        model.observe(4, device_seconds(4))
    overhead, per_token = model.fit()  # type: ignore[misc]
    assert overhead == 0.0 and per_token == pytest.approx(device_seconds(4) / 4)


def test_one_slow_step_is_set_aside_but_a_lasting_change_is_learned() -> None:
    model = StepTimeModel()
    for n in (1, 100, 1, 100):
        model.observe(n, device_seconds(n))
    before = model.fit()
    model.observe(100, 50.0)  # a kernel compiling
    assert model.fit() == before
    for _ in range(3):  # the device really got slower
        model.observe(100, 50.0)
    assert model.predict(100) > 10 * device_seconds(100)  # type: ignore[operator]


def _run_beside_a_decode(
    target_ms: float, per_token: float
) -> tuple[list[tuple[int, bool]], list[int], object]:
    """A short request decodes while a 400-token prompt arrives; every step's time is
    reported from the simulated device. Returns, per step, (tokens, a decode ran), the
    prompt's chunk sizes, and the requests."""
    scheduler, runner = make_scheduler(
        num_blocks=256, budget=256, decode_latency_target_ms=target_ms
    )
    stream = make_request("stream", 5, max_tokens=60)
    prompt = make_request("prompt", list(range(1000, 1400)), max_tokens=2)
    scheduler.add_request(stream)
    steps: list[tuple[int, bool]] = []
    chunks: list[int] = []
    for i in range(500):
        if i == 3:
            scheduler.add_request(prompt)
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        check_plan(plan, scheduler)
        counts = plan.num_scheduled_tokens
        steps.append((plan.total_num_scheduled_tokens, counts.get("stream") == 1))
        if "prompt" in counts and prompt.num_output_tokens == 0:
            chunks.append(counts["prompt"])
        scheduler.update(plan, runner.execute(plan))
        n = plan.total_num_scheduled_tokens
        scheduler.record_step_time(n, device_seconds(n, per_token=per_token))
    assert not scheduler.has_unfinished_requests()
    for request in (stream, prompt):
        assert request.output_token_ids == expected_output(request)
    assert_all_blocks_back(scheduler)
    return steps, chunks, (stream, prompt)


def test_prefill_beside_a_decode_keeps_steps_under_the_target() -> None:
    steps, chunks, _ = _run_beside_a_decode(target_ms=100.0, per_token=0.001)
    # (100 ms - 10 ms) / 1 ms = 90 tokens per step while the stream decodes.
    beside = [n for n, decoding in steps if decoding]
    assert max(beside) <= 90
    assert device_seconds(max(beside)) <= 0.1
    assert sum(chunks) == 400 and max(chunks) <= 89  # 90 minus the decode's token
    # The first chunks double from the largest step measured (the stream's 5-token
    # prefill), then hold at the target: the cap is not needlessly small.
    assert chunks[:5] == [9, 19, 39, 79, 89]
    # Once the stream is done the prompt's last chunk is no longer capped.
    steps_off, chunks_off, _ = _run_beside_a_decode(target_ms=0.0, per_token=0.001)
    assert max(chunks_off) == 255  # the whole budget minus the decode: a 265 ms step
    assert max(n for n, decoding in steps_off if decoding) == 256


def test_a_very_slow_device_still_prefills_a_block_per_step() -> None:
    # 50 ms per token: even one prefill token breaks a 20 ms target; the prompt still
    # progresses by one block per step rather than starving.
    _, chunks, _ = _run_beside_a_decode(target_ms=20.0, per_token=0.05)
    assert sum(chunks) == 400
    assert set(chunks[:-1]) == {BS}
