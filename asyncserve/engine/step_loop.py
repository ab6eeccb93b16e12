"""The step loop: one asyncio task that plans steps and hands them to the executor.

One loop for both scheduling modes, with up to `depth` steps in flight:

- depth 1 (synchronous scheduling): plan N, launch N, publish N-1 while N computes, collect
  N, update. The scheduler sees every token before it plans the next step.
- depth 2 (async scheduling, the default with CUDA): plan and launch N+1 before N's tokens
  are back, so the device never waits for the host between steps; N+1 reads N's tokens on
  the device (a token in flight is a placeholder, see core/scheduler.py). Then collect N,
  update, publish N while N+1 computes.
- depth P (pipeline parallelism over P stages: Executor.max_concurrent_batches): P steps
  in flight, each with requests the others do not hold (core/micro_batches.py), so every
  stage works on one. This replaces async scheduling's one step ahead: a request's next
  step cannot start on the first stage before the last stage has sampled its token.

Where sampling N+1 needs N's tokens on the host (grammar masks, penalties, bad words), N+1's
forward is still launched at once; its sampling is queued behind the collection of N, and
its masks are filled once the matchers have taken N's tokens, while the forward runs.

The event loop never blocks on a device: it awaits futures. After queueing a forward it
first waits until the forward is enqueued: its own Python work would otherwise hold the GIL
and delay the launch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from asyncserve.core.request import Request
from asyncserve.core.step import GrammarBitmask, StepPlan, StepResult
from asyncserve.engine.engine_core import EngineCore
from asyncserve.executor.abstract import Executor, MasksFuture

# A collected step's outputs, published once: (updated requests, result, grammar-done ids).
Collected = tuple[list[Request], StepResult, list[str]]


@dataclass
class _InFlight:
    """A launched step whose tokens are not taken yet."""

    plan: StepPlan
    sampling: Future[Any]
    # The step's grammar masks (None without live grammars): filled once the matchers have
    # every earlier token; the fill must be over before they advance again.
    masks: MasksFuture | None
    masks_submitted: bool = False
    collecting: Future[StepResult] | None = None
    launched_at: float = 0.0  # time.monotonic() when its forward was queued


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody waits
        loop.call_soon_threadsafe(_resolve, future)


def _copy_future(source: Future[GrammarBitmask], target: MasksFuture) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


class StepLoop:
    """Drives the engine core and the executor, one step after another."""

    def __init__(
        self, core: EngineCore, executor: Executor, async_scheduling: bool, time_steps: bool = False
    ) -> None:
        self.core = core
        self.executor = executor
        self.depth = 2 if async_scheduling else 1
        if executor.max_concurrent_batches > 1:
            self.depth = executor.max_concurrent_batches
        # The most steps that were in flight at once (pipeline stages kept busy).
        self.max_in_flight = 0
        # Also charge each step's device time to its requests (detailed traces).
        self.time_steps = time_steps
        # When the last step's tokens were collected: a step queued behind another starts
        # on the device only then.
        self._last_collected_at = 0.0

    async def run(self, wakeup: asyncio.Event, stopping: Callable[[], bool]) -> None:
        """Step until `stopping()`; sleeps on `wakeup` while there is nothing to do. A failed
        step raises: the engine fails every request then."""
        loop = asyncio.get_running_loop()
        in_flight: deque[_InFlight] = deque()
        pending: Collected | None = None
        try:
            while not stopping():
                launched = False
                if len(in_flight) < self.depth:
                    plan = self.core.schedule()
                    if not plan.is_empty or plan.freed_request_ids:
                        prev = in_flight[-1] if in_flight else None
                        in_flight.append(await self._launch(loop, plan, prev))
                        launched = True
                        self.max_in_flight = max(self.max_in_flight, len(in_flight))
                if pending is not None:
                    # Overlap: publish the last step's tokens while this one computes.
                    self.core.publish(*pending)
                    pending = None
                if in_flight and (len(in_flight) >= self.depth or not launched):
                    done = in_flight.popleft()
                    pending = await self._collect(done, in_flight[0] if in_flight else None)
                    if in_flight:  # the device has the next step: publish at once
                        self.core.publish(*pending)
                        pending = None
                elif not launched and pending is None:
                    # Nothing to run: sleep until a request arrives, ends, or we stop.
                    wakeup.clear()
                    await wakeup.wait()
            while in_flight:
                done = in_flight.popleft()
                self.core.publish(*await self._collect(done, in_flight[0] if in_flight else None))
            if pending is not None:
                self.core.publish(*pending)
        finally:
            for step in in_flight:  # never leave a worker waiting for masks
                if step.masks is not None and not step.masks.done():
                    step.masks.set_result(None)

    async def _launch(
        self, loop: asyncio.AbstractEventLoop, plan: StepPlan, prev: _InFlight | None
    ) -> _InFlight:
        """Queue the plan's forward and sampling; return once the forward is enqueued."""
        masks: MasksFuture | None = Future() if self.core.structured.num_requests else None
        launched_at = time.monotonic()
        forward_enqueued: asyncio.Future[None] = loop.create_future()
        forwarded = self.executor.launch_forward(
            plan, functools.partial(_resolve_threadsafe, loop, forward_enqueued)
        )
        if prev is not None and (masks is not None or plan.needs_output_tokens):
            # Sampling reads the previous step's tokens: collect it first on the workers.
            prev.collecting = self.executor.collect(prev.sampling)
        step = _InFlight(
            plan, self.executor.launch_sampling(forwarded, masks), masks, launched_at=launched_at
        )
        try:
            await forward_enqueued
        except BaseException:
            if masks is not None and not masks.done():
                masks.set_result(None)
            raise
        if prev is None:
            self._fill_masks(step)  # the matchers already hold every earlier token
        return step

    async def _collect(self, step: _InFlight, following: _InFlight | None) -> Collected:
        """Wait for a step's tokens and update the core with them; then the step after it
        can have its masks (they depend on these tokens)."""
        if step.collecting is None:
            step.collecting = self.executor.collect(step.sampling)
        try:
            result = await asyncio.wrap_future(step.collecting)
        finally:
            if step.masks is not None and not step.masks.done():
                step.masks.set_result(None)  # the step failed before it sampled
        self._record_step_time(step)
        updated, grammar_done = self.core.update(step.plan, result)
        if following is not None:
            self._fill_masks(following)
        return updated, result, grammar_done

    def _record_step_time(self, step: _InFlight) -> None:
        """How long the step kept the device: from its launch, or from the collection of
        the step before it when it was queued behind that one."""
        now = time.monotonic()
        started = max(step.launched_at, self._last_collected_at)
        self._last_collected_at = now
        num_tokens = step.plan.total_num_scheduled_tokens
        if num_tokens:
            self.core.scheduler.record_step_time(num_tokens, now - started)
        if self.time_steps:
            get = self.core.scheduler.get_request
            for request_id in step.plan.num_scheduled_tokens:
                request = get(request_id)
                if request is not None:
                    request.model_execute_time += now - started

    def _fill_masks(self, step: _InFlight) -> None:
        """Resolve the step's masks future with the masks of its constrained sampling rows
        (filled on the grammar thread), or None when there are none."""
        masks = step.masks
        if masks is None or step.masks_submitted:
            return
        step.masks_submitted = True
        structured = self.core.structured
        try:
            filled = structured.submit(step.plan, self.core.scheduler.get_request)
        except BaseException as exc:
            masks.set_exception(exc)
            raise
        if filled is None:
            masks.set_result(None)
        else:
            filled.add_done_callback(lambda done: _copy_future(done, masks))
