"""The step loop: one asyncio task that schedules steps and runs them on a worker thread.

Each iteration schedules a step, hands it to a worker thread (the forward pass), and while
the device works, detokenizes and publishes the previous step's tokens on the event loop.
The event loop never blocks on the device: it awaits the worker's future.

With async scheduling (the default with CUDA) the loop plans and launches step N+1 before
step N's tokens are back, so the device never waits for the host between steps; N+1 reads
N's tokens on the device. Where sampling N+1 needs N's tokens on the host (grammar masks,
penalties), N+1's forward is launched first and its sampling after N is collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.scheduler import Scheduler
from asyncserve.core.step import GrammarBitmask, StepPlan, StepResult
from asyncserve.metrics import EngineMetrics
from asyncserve.output.output_processor import OutputProcessor
from asyncserve.worker.model_runner import ForwardedStep, LaunchedStep, ModelRunner

_T = TypeVar("_T")


def _copy_future(source: Future[GrammarBitmask], target: Future[GrammarBitmask | None]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody waits
        loop.call_soon_threadsafe(_resolve, future)


async def _filled(masks: Future[GrammarBitmask | None] | None) -> None:
    """Wait until a step's mask fill is over (the runner usually waited for it already)."""
    if masks is not None and not masks.done():
        await asyncio.wrap_future(masks)


def _sample_forwarded(
    runner: ModelRunner,
    forwarded: Future[ForwardedStep],
    masks: Future[GrammarBitmask | None] | None,
) -> LaunchedStep:
    """Step-thread job: sample a step whose forward was enqueued by an earlier job."""
    return runner.launch_sampling(forwarded.result(), masks)


@dataclass
class _InFlight:
    """A launched step whose tokens are not collected yet (async scheduling)."""

    plan: StepPlan
    launching: asyncio.Future[LaunchedStep]
    # Its grammar masks; their fill must be over before the matchers advance again.
    masks: Future[GrammarBitmask | None] | None


class StepLoop:
    """Drives the scheduler and the runner, one step after another, for the engine."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        structured: StructuredOutputManager,
        output_processor: OutputProcessor,
        metrics: EngineMetrics | None,
        async_scheduling: bool,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.structured = structured
        self.output_processor = output_processor
        self.metrics = metrics
        self.async_scheduling = async_scheduling
        # The step thread: launches, collects; one at a time, in submission order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")
        # Scheduler counters already reported to metrics.
        self._seen_preemptions = 0
        self._seen_queries = 0
        self._seen_hits = 0

    async def run(self, wakeup: asyncio.Event, stopping: Callable[[], bool]) -> None:
        """Step until `stopping()`; sleeps on `wakeup` while there is nothing to do. A failed
        step raises: the engine fails every request then."""
        loop = asyncio.get_running_loop()
        # The last step's requests and result, published while the next step computes.
        pending: tuple[list[Request], StepResult] | None = None
        # Async scheduling: a launched step whose tokens are not collected yet.
        in_flight: _InFlight | None = None
        while not stopping():
            if in_flight is not None:
                in_flight = await self._overlapped_step(loop, in_flight)
                continue
            if not self.scheduler.has_unfinished_requests() and pending is None:
                wakeup.clear()
                await wakeup.wait()
                continue
            plan = self._schedule()
            # With live grammars the runner gets a future of this step's masks: it waits
            # for it only right before sampling, so the matchers advance by the last
            # step's tokens, and the masks fill, while the forward already runs.
            masks: Future[GrammarBitmask | None] | None = (
                Future() if self.structured.num_requests else None
            )
            future: asyncio.Future[Any] | None = None
            launched: asyncio.Future[None] | None = None
            if not plan.is_empty or plan.freed_request_ids:
                step_fn = self.runner.launch if self.async_scheduling else self.runner.execute
                job, launched = self._submit_step(loop, step_fn, plan, masks)
                future = asyncio.wrap_future(job)
            try:
                if launched is not None:
                    # The step thread builds the inputs and launches the forward first:
                    # the work below would hold the GIL and delay the launch.
                    await launched
                grammar_done = self._advance_grammars(pending[0]) if pending else []
            except BaseException:
                if masks is not None and not masks.done():
                    masks.set_result(None)  # never leave the runner waiting
                raise
            if masks is not None:
                self._fill_masks(plan, masks)
            # Overlap: publish the previous step's tokens while this one computes.
            if pending is not None:
                self._publish(*pending, grammar_done)
                pending = None
            if future is None:
                await asyncio.sleep(0.001)
            elif self.async_scheduling:
                in_flight = _InFlight(plan, future, masks)
            else:
                result = await future
                await _filled(masks)
                pending = (self.scheduler.update(plan, result), result)
                self._record_step()
        if in_flight is not None:
            step = await in_flight.launching
            await _filled(in_flight.masks)
            await self._finish_step(loop, in_flight.plan, step)
        if pending is not None:
            self._publish(*pending, self._advance_grammars(pending[0]))

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        for request in self.scheduler.take_errored():
            self.structured.remove([request.request_id])
            self.output_processor.fail_request(request.request_id, request.error or "")
        return plan

    def _submit_step(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., _T], *args: Any
    ) -> tuple[Future[_T], asyncio.Future[None]]:
        """Queue `fn(*args, on_launched)` on the step thread. Returns its job and a future
        that resolves once it has enqueued its forward pass."""
        launched: asyncio.Future[None] = loop.create_future()
        on_launched = functools.partial(_resolve_threadsafe, loop, launched)
        job = self._executor.submit(fn, *args, on_launched)
        # A job that fails before it launches never calls on_launched: its end resolves the
        # wait, and awaiting the job then raises its error.
        job.add_done_callback(lambda _: on_launched())
        return job, launched

    async def _launch(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., _T], *args: Any
    ) -> Future[_T]:
        """`_submit_step`, returning once the forward pass is enqueued: our own Python work
        would hold the GIL and delay the launch."""
        job, launched = self._submit_step(loop, fn, *args)
        await launched
        return job

    async def _overlapped_step(
        self, loop: asyncio.AbstractEventLoop, current: _InFlight
    ) -> _InFlight | None:
        """Launch the step after `current`, then collect, update and publish `current`.

        Returns the newly launched step, or None when there is nothing to launch.
        """
        step = await current.launching
        # The fill read the matchers; it must be over before they advance again.
        await _filled(current.masks)
        plan = self._schedule()
        if plan.is_empty and not plan.freed_request_ids:
            await self._finish_step(loop, current.plan, step)
            return None
        if not step.needs_tokens and not self.structured.num_requests:
            # Sampling the next step needs nothing from this one: enqueue it whole.
            launching = asyncio.wrap_future(
                await self._launch(loop, self.runner.launch, plan, None)
            )
            await self._finish_step(loop, current.plan, step)
            return _InFlight(plan, launching, None)
        # Sampling the next step needs this step's tokens (grammar masks, penalties): its
        # forward is enqueued now, its sampling after this step is collected, on the same
        # step thread, so both overlap the forward.
        masks: Future[GrammarBitmask | None] | None = (
            Future() if self.structured.num_requests else None
        )
        forwarded = await self._launch(loop, self.runner.launch_forward, plan)
        collecting = loop.run_in_executor(self._executor, self.runner.collect, step)
        launching = loop.run_in_executor(
            self._executor, _sample_forwarded, self.runner, forwarded, masks
        )
        try:
            result = await collecting
            updated = self.scheduler.update(current.plan, result)
            self._record_step()
            grammar_done = self._advance_grammars(updated)
        except BaseException:
            if masks is not None and not masks.done():
                masks.set_result(None)  # never leave the runner waiting
            raise
        if masks is not None:
            self._fill_masks(plan, masks)
        self._publish(updated, result, grammar_done)
        return _InFlight(plan, launching, masks)

    async def _finish_step(
        self, loop: asyncio.AbstractEventLoop, plan: StepPlan, step: LaunchedStep
    ) -> None:
        """Wait for a launched step's tokens, update the scheduler, publish them."""
        result = await loop.run_in_executor(self._executor, self.runner.collect, step)
        updated = self.scheduler.update(plan, result)
        self._record_step()
        self._publish(updated, result, self._advance_grammars(updated))

    def _publish(self, updated: list[Request], result: StepResult, grammar_done: list[str]) -> None:
        processed = self.output_processor.process(updated, result, grammar_done)
        if processed.stopped:
            self.scheduler.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
            self.structured.remove(processed.stopped)
        if processed.failed:
            self.scheduler.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
            self.structured.remove(processed.failed)

    def _fill_masks(self, plan: StepPlan, masks: Future[GrammarBitmask | None]) -> None:
        """Resolve `masks` with the masks of `plan`'s constrained sampling rows (filled on
        the grammar thread), or None when there are none. Always resolves it: the runner
        waits on it."""
        try:
            filled = self.structured.submit(plan, self.scheduler.get_request)
        except BaseException as exc:
            masks.set_exception(exc)
            raise
        if filled is None:
            masks.set_result(None)
        else:
            filled.add_done_callback(lambda done: _copy_future(done, masks))

    def _advance_grammars(self, updated: list[Request]) -> list[str]:
        """Feed the last step's tokens to the grammar matchers (the next step is already
        planned and running; the masks it samples with are filled after this).

        A request whose grammar is complete ends now ("stop"): its row in the running step
        computes one token that is dropped. Returns their ids.
        """
        if not self.structured.num_requests:
            return []
        accepted = self.structured.accept_tokens(updated)
        if accepted.stopped:
            self.scheduler.finish_requests(accepted.stopped, RequestStatus.FINISHED_STOPPED)
        for request_id, error in accepted.errored:
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
            self.output_processor.fail_request(request_id, error)
        return accepted.stopped

    def _record_step(self) -> None:
        if self.metrics is None:
            return
        s = self.scheduler
        self.metrics.on_step(s.num_running, s.num_waiting, s.kv_cache_usage)
        preemptions = s.num_preemptions_total - self._seen_preemptions
        if preemptions:
            self.metrics.on_preemptions(preemptions)
        self._seen_preemptions = s.num_preemptions_total
        queries = s.prefix_cache_queries - self._seen_queries
        hits = s.prefix_cache_hits - self._seen_hits
        if queries:
            self.metrics.on_prefix_cache(queries, hits)
        self._seen_queries = s.prefix_cache_queries
        self._seen_hits = s.prefix_cache_hits
