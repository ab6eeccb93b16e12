"""Pipeline parallelism over Ray actors (2 stages, gloo on CPU) with one micro-batch per stage
in flight: greedy and seeded outputs equal one device token for token through chunked
prefill, prefix hits and preemption; stop strings and an abort of a request whose step is
in the pipeline end only that request; two steps are in flight at once; a stage that dies
fails every running request with an error naming it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from asyncserve import LLM, RequestOutput, SamplingParams
from asyncserve.executor.ray_executor import RayExecutor
from tests.engine.test_tensor_parallel import ENGINE_ARGS, _generate, _prompts


@pytest.fixture(scope="module")
def single(tiny_llama: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama), **ENGINE_ARGS)  # type: ignore[arg-type]
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def pp_llm(ray_cluster: Any, tiny_llama: Path) -> Iterator[LLM]:
    # One rank per stage, one layer each.
    llm = LLM(
        str(tiny_llama),
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE_ARGS,  # type: ignore[arg-type]
    )
    yield llm
    llm.close()


def _assert_drained(llm: LLM) -> None:
    """No step left in flight (a request ended by a stop string or an abort may have
    had one still in the pipeline: the step loop takes it back on its own), no request
    left behind, every block back."""
    engine = llm.engine
    micro = engine.scheduler.micro_batches
    for _ in range(100):
        if not micro._in_flight:
            break
        llm._loop.run_until_complete(asyncio.sleep(0.05))
    assert micro._in_flight == {} and micro._sent == {}
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.scheduler.has_unfinished_requests()


def test_greedy_equals_one_device_with_two_steps_in_flight(single: LLM, pp_llm: LLM) -> None:
    assert pp_llm.engine.executor.max_concurrent_batches == 2
    assert pp_llm.engine.step_loop.depth == 2
    assert _generate(pp_llm) == _generate(single)
    # Both stages had a step of their own: the step loop kept two in flight.
    assert pp_llm.engine.step_loop.max_in_flight == 2
    scheduler = pp_llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0 and scheduler.prefix_cache_hits > 0
    _assert_drained(pp_llm)


def test_seeded_sampling_and_stop_strings_equal_one_device(single: LLM, pp_llm: LLM) -> None:
    prompts = _prompts()
    seeded = [
        SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = single.generate(prompts, seeded, use_tqdm=False)
    got = pp_llm.generate(prompts, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # A stop string from the middle of each greedy output ends it there on both.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = [o.outputs[0].text for o in single.generate(prompts, greedy, use_tqdm=False)]
    stopped = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[t[len(t) // 2 :][:4]])
        for t in texts
    ]
    want = single.generate(prompts, stopped, use_tqdm=False)
    got = pp_llm.generate(prompts, stopped, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in got] == [
        (o.outputs[0].text, o.outputs[0].token_ids) for o in want
    ]
    _assert_drained(pp_llm)


def test_abort_of_a_request_in_flight(single: LLM, pp_llm: LLM) -> None:
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in single.generate(prompts, params, use_tqdm=False)]
    engine = pp_llm.engine
    aborted_in_flight: list[bool] = []

    async def one(i: int) -> RequestOutput:
        last = None
        async for out in engine.generate(prompts[i], params, f"abort-{i}"):
            last = out
            if i == 1 and len(out.outputs[0].token_ids) >= 3 and not aborted_in_flight:
                # Aborted once its next step is in the pipeline (the step loop launches
                # it before this task runs, unless it was preempted meanwhile).
                request = engine.scheduler.get_request("abort-1")
                if request is not None and engine.scheduler.micro_batches.busy(request):
                    aborted_in_flight.append(True)
                    await engine.abort("abort-1")
        assert last is not None
        return last

    async def run() -> list[RequestOutput]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    outs = pp_llm._loop.run_until_complete(run())
    assert aborted_in_flight == [True]
    victim = outs[1].outputs[0]
    assert victim.finish_reason == "abort"
    assert (
        3 <= len(victim.token_ids) < 12
        and list(victim.token_ids) == want[1][: len(victim.token_ids)]
    )
    for i in (0, 2, 3):
        assert list(outs[i].outputs[0].token_ids) == want[i]
    _assert_drained(pp_llm)
    # The engine goes on as before.
    assert _generate(pp_llm) == _generate(single)


def test_killed_stage_ends_the_engine(pp_llm: LLM) -> None:
    # Last in this module: it ends the shared engine. The first stage's actor dies while
    # steps are in the pipeline; the second stage is left waiting on its hand-over.
    executor = pp_llm.engine.executor
    assert isinstance(executor, RayExecutor)
    engine = pp_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def one(i: int) -> RequestOutput:
        last = None
        async for out in engine.generate(_prompts()[i], params, f"killed-{i}"):
            if last is None and i == 0:
                ray.kill(executor.workers[0])
            last = out
        assert last is not None
        return last

    async def run() -> list[RequestOutput]:
        return list(await asyncio.gather(*(one(i) for i in range(3))))

    outs = pp_llm._loop.run_until_complete(run())
    for out in outs:
        assert out.error is not None and "worker 0" in out.error and "died" in out.error
        assert len(out.outputs[0].token_ids) < 50
    group = executor._group
    pp_llm.close()
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
