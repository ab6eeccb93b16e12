"""The step loop's order of work, with synchronous (depth 1) and async (depth 2) scheduling,
on the real core (scheduler, outputs) and a model-free runner behind the real executor."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncserve.config import CacheConfig, SchedulerConfig
from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.core.scheduler import Scheduler
from asyncserve.core.step import StepPlan, StepResult
from asyncserve.engine.engine_core import EngineCore
from asyncserve.engine.step_loop import StepLoop
from asyncserve.executor.uniproc import UniProcExecutor
from asyncserve.output.output_processor import OutputProcessor, ParentState
from asyncserve.output.request_stream import RequestStream
from asyncserve.sampling_params import RequestOutputKind
from asyncserve.tokenizer import Tokenizer
from tests.core.fake_runner import BS, VOCAB, FakeRunner, expected_output, make_request


class StagedRunner:
    """FakeRunner behind the three stages of a step, recording their order."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.fake = FakeRunner(64, BS, VOCAB)
        self.events = events
        self.steps = 0

    def launch_forward(self, plan: StepPlan, on_launched: Any) -> tuple[int, StepPlan]:
        self.steps += 1
        self.events.append(("forward", self.steps))
        on_launched()
        return self.steps, plan

    def launch_sampling(self, forwarded: tuple[int, StepPlan], masks: Any) -> Any:
        number, plan = forwarded
        self.events.append(("sample", number))
        return number, self.fake.execute(plan)

    def collect(self, launched: tuple[int, StepResult]) -> StepResult:
        self.events.append(("collect", launched[0]))
        return launched[1]

    def release(self) -> None:
        """The executor's shutdown frees the runner's memory; a fake holds none."""


def run(depth: int) -> tuple[list[tuple[str, int]], dict[str, list[int]]]:
    events: list[tuple[str, int]] = []
    tokenizer = Tokenizer.byte_level(VOCAB, None, [])
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS), 64, 1024)
    outputs = OutputProcessor(tokenizer, 1, None)
    structured = StructuredOutputManager(tokenizer.backend, VOCAB, [], pin_memory=False)
    core = EngineCore(scheduler, structured, outputs, None)
    executor = UniProcExecutor(StagedRunner(events))  # type: ignore[arg-type]
    loop = StepLoop(core, executor, async_scheduling=depth == 2)

    update, publish = core.update, core.publish
    core.update = lambda plan, result: (events.append(("update", 0)), update(plan, result))[1]  # type: ignore[method-assign]
    core.publish = lambda *a: (events.append(("publish", 0)), publish(*a))[1]  # type: ignore[method-assign]

    requests = [make_request(f"r{i}", 5 + i, max_tokens=4) for i in range(2)]
    streams = {}
    for request in requests:
        request.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        stream = RequestStream(request.request_id, RequestOutputKind.FINAL_ONLY)
        parent = ParentState(request.request_id, None, request.prompt_token_ids,
                             request.sampling_params, stream)  # fmt: skip
        core.add(parent, [request])
        streams[request.request_id] = stream

    async def main() -> dict[str, list[int]]:
        wakeup = asyncio.Event()
        task = asyncio.create_task(loop.run(wakeup, lambda: False))
        finals = {rid: await s.get() for rid, s in streams.items()}
        task.cancel()
        return {rid: out.outputs[0].token_ids for rid, out in finals.items()}

    tokens = asyncio.run(main())
    for request in requests:
        assert tokens[request.request_id] == expected_output(request)
    executor.shutdown()
    return events, tokens


def order(events: list[tuple[str, int]]) -> list[str]:
    """Events renamed by step: forward/sample/collect carry their step; update and publish
    get the number of the last collected step."""
    out, last = [], 0
    for name, number in events:
        if name == "collect":
            last = number
        out.append(f"{name}{number or last}")
    return out


def test_synchronous_scheduling_plans_after_each_update() -> None:
    events, _ = run(depth=1)
    seq = order(events)
    # Step 2 is planned after step 1's update; step 1 publishes while step 2 computes.
    assert seq.index("forward2") > seq.index("update1")
    assert seq.index("forward2") < seq.index("publish1") < seq.index("collect2")


def test_async_scheduling_launches_the_next_step_first() -> None:
    events, _ = run(depth=2)
    seq = order(events)
    # Step 2 is launched before step 1's tokens are collected; step 1 publishes right after
    # its update, before step 3 is launched.
    assert seq.index("forward2") < seq.index("collect1")
    assert seq.index("update1") < seq.index("publish1") < seq.index("forward3")
