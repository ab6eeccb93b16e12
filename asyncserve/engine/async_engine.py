"""AsyncEngine: add / abort / generate(), and the one asyncio step loop.

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
import copy
import functools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.engine.model_runner import ForwardedStep, LaunchedStep, ModelRunner
from asyncserve.engine.output_processor import OutputProcessor, ParentState
from asyncserve.engine.request import Request, RequestStatus
from asyncserve.engine.request_stream import RequestStream
from asyncserve.engine.scheduler import Scheduler
from asyncserve.engine.step import StepPlan, StepResult
from asyncserve.engine.structured import GrammarBitmask, StructuredOutputManager
from asyncserve.metrics import EngineMetrics
from asyncserve.models.loader import LoadedModel, load_model
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _copy_future(source: Future[GrammarBitmask], target: Future[GrammarBitmask | None]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class AsyncEngine:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel, metrics: EngineMetrics | None = None
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.generation_config = loaded.generation_config
        self.metrics = metrics
        self.device = next(loaded.model.parameters()).device
        self.max_model_len = min(
            config.model.max_model_len or loaded.arch.max_position_embeddings,
            loaded.arch.max_position_embeddings,
        )
        self.runner = ModelRunner(loaded, config, self.device)
        self.async_scheduling = config.scheduler.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.type == "cuda"
        num_blocks = self.runner.determine_num_blocks(self.max_model_len)
        self.runner.allocate_kv_cache(num_blocks, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval, metrics)
        eos_ids = list(loaded.generation_config.get("eos_token_id") or loaded.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids.insert(0, self.tokenizer.eos_token_id)
        self.eos_token_ids: list[int] = eos_ids
        # Grammar matchers; masks are filled on its own thread while the forward runs.
        self.structured = StructuredOutputManager(
            self.tokenizer.backend,
            loaded.arch.vocab_size,
            eos_ids,
            pin_memory=self.device.type == "cuda",
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self._dead_reason: str | None = None
        # Scheduler counters already reported to metrics.
        self._seen_preemptions = 0
        self._seen_queries = 0
        self._seen_hits = 0
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            self.model_path,
            self.device,
            num_blocks,
            config.cache.block_size,
            self.max_model_len,
        )

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: EngineMetrics | None = None) -> AsyncEngine:
        device = resolve_device(config.model.device)
        torch.manual_seed(config.model.seed)
        loaded = load_model(config.model, device)
        return cls(config, loaded, metrics)

    # ---- state for the server ------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return (
            self._loop_task is not None and not self._loop_task.done() and self._dead_reason is None
        )

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage

    @property
    def num_total_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.num_free_blocks

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if self.is_running:
            return
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._loop_task = asyncio.create_task(self._step_loop(), name="asyncserve-step-loop")

    async def shutdown(self, timeout: float | None = None) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, stop."""
        if self._loop_task is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.output_processor.parents and self.is_running:
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        for request_id in list(self.output_processor.parents):
            await self.abort(request_id)
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop_task
        self._loop_task = None

    # ---- requests ------------------------------------------------------------------------

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, strict_max_tokens: bool = True
    ) -> None:
        """Raise ValueError when a request cannot run; the message names what is wrong."""
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.loaded.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt contains token id {bad} outside the vocabulary [0, {vocab})")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {n_prompt} tokens but max_model_len is {self.max_model_len}: "
                "the prompt must be shorter than max_model_len"
            )
        if params.structured_outputs is not None:
            # Compiles the grammar (cached): a bad schema, regex or grammar names its field.
            self.structured.validate(params.structured_outputs)
        if strict_max_tokens and params.max_tokens is not None:
            total = n_prompt + params.max_tokens
            if total > self.max_model_len:
                raise ValueError(
                    f"max_tokens: this model's maximum context length is {self.max_model_len} "
                    f"tokens, but {total} were requested ({n_prompt} in the prompt, "
                    f"{params.max_tokens} in the completion)"
                )

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            # Every EOS id of the model stops; min_tokens masks them all.
            child.all_stop_token_ids = stop_ids | set(self.eos_token_ids)
        else:
            child.all_stop_token_ids = stop_ids
        child.stop_token_ids = sorted(
            stop_ids | (set(self.eos_token_ids[1:]) if not params.ignore_eos else set())
        )
        return child

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> RequestStream:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self._dead_reason is not None:
            raise RuntimeError(f"engine is not running: {self._dead_reason}")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_text = None
            prompt_ids = list(prompt)
        self.validate_request(prompt_ids, params, strict_max_tokens=False)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stream = RequestStream(request_id, params.output_kind)
        parent = ParentState(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            params=params,
            stream=stream,
        )
        requests = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            requests.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=prompt_ids,
                    sampling_params=self._child_params(params, index),
                    eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                    priority=priority,
                    arrival_time=parent.arrival_time,
                    max_tokens=max_tokens,
                )
            )
        if params.structured_outputs is not None:
            for request in requests:
                self.structured.add_request(request.request_id, params.structured_outputs)
        self.output_processor.add(parent, requests)
        for request in requests:
            self.scheduler.add_request(request)
        if self._wakeup is not None:
            self._wakeup.set()
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            await self.start()
        stream = self.add_request(prompt, sampling_params, request_id, priority)
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.child_ids(request_id)
        if not child_ids:
            return
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self.structured.remove(child_ids)
        self.output_processor.finish_aborted(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # ---- the step loop -------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        # The last step's requests and result, published while the next step computes.
        pending: tuple[list[Request], StepResult] | None = None
        # Async scheduling: a launched step whose tokens are not collected yet.
        in_flight: _InFlight | None = None
        assert self._wakeup is not None
        try:
            while not self._stopping:
                if in_flight is not None:
                    in_flight = await self._overlapped_step(loop, in_flight)
                    continue
                if not self.scheduler.has_unfinished_requests() and pending is None:
                    self._wakeup.clear()
                    await self._wakeup.wait()
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
                    launched = loop.create_future()
                    future = loop.run_in_executor(
                        self._executor,
                        self.runner.launch if self.async_scheduling else self.runner.execute,
                        plan,
                        masks,
                        functools.partial(loop.call_soon_threadsafe, _resolve, launched),
                    )
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
        except Exception as exc:  # a failed step: fail every request, report unhealthy
            logger.exception("step loop failed")
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            for request_id in list(self.output_processor.parents):
                self.output_processor.finish_aborted(
                    request_id, reason="error", error=self._dead_reason
                )

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        for request in self.scheduler.take_errored():
            self.structured.remove([request.request_id])
            self.output_processor.fail_request(request.request_id, request.error or "")
        return plan

    async def _launch(
        self, loop: asyncio.AbstractEventLoop, plan: StepPlan
    ) -> asyncio.Future[LaunchedStep]:
        """Hand `plan` to the step thread whole; return once its forward pass is enqueued."""
        launched: asyncio.Future[None] = loop.create_future()
        future = loop.run_in_executor(
            self._executor,
            self.runner.launch,
            plan,
            None,
            functools.partial(loop.call_soon_threadsafe, _resolve, launched),
        )
        # Our own Python work would hold the GIL and delay the launch.
        await launched
        return future

    async def _launch_forward(
        self, loop: asyncio.AbstractEventLoop, plan: StepPlan
    ) -> Future[ForwardedStep]:
        """Hand `plan`'s forward pass to the step thread; return once it is enqueued."""
        launched: asyncio.Future[None] = loop.create_future()
        forwarded = self._executor.submit(
            self.runner.launch_forward,
            plan,
            functools.partial(loop.call_soon_threadsafe, _resolve, launched),
        )
        await launched
        return forwarded

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
            launching = await self._launch(loop, plan)
            await self._finish_step(loop, current.plan, step)
            return _InFlight(plan, launching, None)
        # Sampling the next step needs this step's tokens (grammar masks, penalties): its
        # forward is enqueued now, its sampling after this step is collected, on the same
        # step thread, so both overlap the forward.
        masks: Future[GrammarBitmask | None] | None = (
            Future() if self.structured.num_requests else None
        )
        forwarded = await self._launch_forward(loop, plan)
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
        stopped = self.output_processor.process(updated, result, grammar_done)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            self.structured.remove(stopped)

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
