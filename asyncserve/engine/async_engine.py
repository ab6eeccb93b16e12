"""AsyncEngine: add / abort / generate(), lifecycle, and the task that runs the step loop
(engine/step_loop.py) on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Mapping

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.core.pool_capacity import fit_max_model_len
from asyncserve.core.scheduler import Scheduler
from asyncserve.disagg.engine_hooks import (
    check_kv_transfer_params,
    failed_output,
    make_kv_transfer,
)
from asyncserve.disagg.kv_transfer import KVTransferError
from asyncserve.engine.admission import bad_words_token_ids, build_request
from asyncserve.engine.engine_core import EngineCore
from asyncserve.engine.multimodal import MultiModalFrontEnd
from asyncserve.engine.request_checks import (
    check_priority,
    check_request,
    check_token_params,
    resolve_logprobs,
    resolve_top_k,
    truncate_prompt,
)
from asyncserve.engine.setup import eos_token_ids, load_for_engine, make_tracer, resolve_device
from asyncserve.engine.step_loop import StepLoop
from asyncserve.executor.abstract import Executor
from asyncserve.executor.uniproc import UniProcExecutor
from asyncserve.lora.adapter import check_adapter_files, load_adapter
from asyncserve.lora.layers import module_shapes
from asyncserve.lora.request import LoRARequest
from asyncserve.metrics import EngineMetrics
from asyncserve.models.loader import LoadedModel
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.output.output_processor import OutputProcessor
from asyncserve.output.request_stream import RequestStream
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        metrics: EngineMetrics | None = None,
        executor: Executor | None = None,
    ) -> None:
        """`executor`: the workers when they run elsewhere (tensor parallelism); then
        `loaded` holds no weights. None: `loaded` runs here on one step thread."""
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.generation_config = loaded.generation_config
        self.metrics = metrics
        self.runner: ModelRunner | None = None
        if executor is None:
            self.device = next(loaded.model.parameters()).device
        else:
            self.device = resolve_device(config.model.device)
        model_len = loaded.arch.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or model_len, model_len)
        # Adapter targets, read before the runner wraps the projections.
        self.lora_shapes = module_shapes(loaded.model) if config.lora.enable_lora else {}
        # Validated adapters by lora_int_id (the runner loads their weights on first use).
        self.loras: dict[int, LoRARequest] = {}
        if executor is None:
            self.runner = ModelRunner(loaded, config, self.device)
            executor = UniProcExecutor(self.runner)
        self.executor = executor
        num_blocks = self.executor.determine_num_blocks(self.max_model_len)
        self.executor.allocate_kv_cache(num_blocks, self.max_model_len)
        self.num_blocks = num_blocks
        self.max_model_len = fit_max_model_len(
            self.max_model_len, config, num_blocks, loaded.arch.kv_sliding_window
        )
        spec = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.max_model_len,
            config.lora.max_loras if config.lora.enable_lora else None,
            sliding_window=loaded.arch.kv_sliding_window,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec is not None else 0,
            max_concurrent_batches=executor.max_concurrent_batches,
        )
        self.kv_transfer = make_kv_transfer(
            config, self.scheduler, executor, loaded.arch.num_key_value_heads, self.device
        )
        self.tracer = make_tracer(config, self.model_path)
        self.output_processor = OutputProcessor(
            self.tokenizer, config.stream_interval, metrics, self.tracer
        )
        self.eos_token_ids = eos_token_ids(loaded, self.tokenizer.eos_token_id)
        self.multimodal = MultiModalFrontEnd.build(loaded, config)
        # Grammar matchers; masks are filled on its own thread while the forward runs.
        self.structured = StructuredOutputManager(
            self.tokenizer.backend,
            loaded.arch.vocab_size,
            self.eos_token_ids,
            pin_memory=self.device.type == "cuda",
        )
        self.core = EngineCore(self.scheduler, self.structured, self.output_processor, metrics)
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda"
        if config.speculative is not None:
            # A step's proposals come from the tokens of the step before: one step in flight.
            if async_scheduling and config.scheduler.async_scheduling:
                logger.info("speculative decoding runs with synchronous scheduling")
            async_scheduling = False
        self.step_loop = StepLoop(
            self.core,
            self.executor,
            async_scheduling,
            time_steps=self.tracer is not None and self.tracer.detailed,
        )
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        # Set from another thread when the workers fail between steps; the loop raises it.
        self._worker_failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        executor.on_failure(self._on_worker_failure)
        self._dead_reason: str | None = None
        # Set once the step loop has failed for good (see wait_until_dead).
        self._dead = asyncio.Event()
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
        loaded, executor = load_for_engine(config, device)
        if executor is None:
            return cls(config, loaded, metrics)
        try:
            return cls(config, loaded, metrics, executor)
        except BaseException:
            executor.shutdown()
            raise

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
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.num_free_blocks

    # ---- lifecycle -----------------------------------------------------------------------

    async def wait_until_dead(self) -> str:
        """Return (with the reason) once the engine has stopped for good after a failure;
        a normal shutdown never returns here. The server exits non-zero on it."""
        await self._dead.wait()
        return self._dead_reason or "the engine stopped"

    async def start(self) -> None:
        if self.is_running:
            return
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self._loop_task = asyncio.create_task(self._step_loop(), name="asyncserve-step-loop")

    async def shutdown(self, timeout: float | None = None) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, stop."""
        if self._loop_task is None:
            return
        if self.is_running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.core.idle.wait(), timeout)
        for request_id in list(self.output_processor.parents):
            await self.abort(request_id)
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop_task
        self._loop_task = None
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.flush)

    async def close(self) -> None:
        """Shut down, then stop the workers for good (worker processes end here)."""
        await self.shutdown(timeout=0)
        # Transfers first: they read the KV cache, which the executor's shutdown frees.
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        await asyncio.to_thread(self.executor.shutdown)
        if self.tracer is not None:
            self.tracer.shutdown()

    # ---- requests ------------------------------------------------------------------------

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, strict_max_tokens: bool = True
    ) -> None:
        """Raise ValueError when a request cannot run; the message names what is wrong."""
        if params.kv_transfer_params is not None:
            check_kv_transfer_params(self.kv_transfer, params)
        check_request(
            prompt_token_ids,
            params,
            self.loaded.arch.vocab_size,
            self.max_model_len,
            self.structured,
            strict_max_tokens,
        )

    # ---- LoRA adapters ---------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validate an adapter (config and tensor shapes against this model) and register it;
        False when it is registered already. Raises ValueError naming what is wrong."""
        lora = self.config.lora
        if not lora.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled (enable_lora=True / --enable-lora)")
        broken = self.core.broken_loras.get(lora_request.lora_int_id)
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (
                lora_request.lora_name,
                lora_request.lora_path,
            ):
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already used by adapter "
                    f"{known.lora_name!r} at {known.lora_path!r}"
                )
            if broken is None:
                check_adapter_files(known.lora_name, known.lora_path)
                return False
        # A full read (not only the header): weights that fail to load would otherwise
        # fail a step on the worker.
        try:
            load_adapter(
                lora_request.lora_name,
                lora_request.lora_path,
                self.lora_shapes,
                lora.max_lora_rank,
                self.loaded.dtype,
            )
        except ValueError as exc:
            if broken is not None:  # still unreadable: say so, as a request for it would
                raise ValueError(f"{broken} (loading it again failed: {exc})") from None
            raise
        # Loaded again after the runner could not read it: requests may use it again.
        self.core.broken_loras.pop(lora_request.lora_int_id, None)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def lora_error(self, lora_int_id: int) -> str | None:
        """Why requests for this adapter are refused (the runner could not read it since it
        was loaded); None when it may be used."""
        return self.core.broken_loras.get(lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; its cached weights go with the next step. Requests running
        with it finish with it (their weights reload from its path if they must)."""
        self.core.broken_loras.pop(lora_int_id, None)
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.scheduler.remove_lora(lora_int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def check_token_params(self, params: SamplingParams) -> None:
        """allowed_token_ids and logit_bias name only tokens of the vocabulary."""
        check_token_params(params, self.loaded.arch.vocab_size)

    def truncate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return truncate_prompt(prompt_ids, params, self.max_model_len)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids at the start of the text and after a space (where the
        tokenizer spells it with its own tokens), as vLLM rules them out."""
        return bad_words_token_ids(self.tokenizer, words)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: MultiModalInputs | None = None,
    ) -> RequestStream:
        """`mm_inputs`: the prompt's images, processed (self.multimodal.process); its
        expanded token ids replace the prompt's."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority)
        if self._dead_reason is not None:
            raise RuntimeError(f"engine is not running: {self._dead_reason}")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_text = None
            prompt_ids = list(prompt)
        if mm_inputs is not None:
            prompt_ids = list(mm_inputs.prompt_token_ids)  # images are never truncated away
        else:
            prompt_ids = self.truncate_prompt(prompt_ids, params)
            self.multimodal.check_text_prompt(prompt_ids)
        self.validate_request(prompt_ids, params, strict_max_tokens=False)
        vocab_size = self.loaded.arch.vocab_size  # logprobs -1: every token; top_k >= it: none
        params = resolve_top_k(resolve_logprobs(params, vocab_size), vocab_size)
        if lora_request is not None:
            if (broken := self.lora_error(lora_request.lora_int_id)) is not None:
                raise ValueError(f"lora_request: {broken}")
            self.add_lora(lora_request)
        if params.bad_words:
            words = params.bad_words
            params = copy.copy(params)
            params.bad_words_token_ids = self.bad_words_token_ids(words)
        parent, requests = build_request(
            request_id, prompt_text, prompt_ids, params, priority, trace_headers,
            lora_request, mm_inputs, self.max_model_len, self.eos_token_ids,
        )  # fmt: skip
        self.core.add(parent, requests)
        if self._wakeup is not None:
            self._wakeup.set()
        return parent.stream

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: MultiModalInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`trace_headers`: the W3C trace context of the HTTP request, when tracing is on."""
        if not self.is_running:
            await self.start()
        transfer = sampling_params.kv_transfer_params
        if transfer is not None:
            check_kv_transfer_params(self.kv_transfer, sampling_params)
        if self.kv_transfer is not None and transfer and transfer.get("do_remote_prefill"):
            # A consumer: the prompt's KV blocks come from the producer first.
            ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, True)
            try:
                await self.kv_transfer.pull(ids, transfer)
            except KVTransferError as exc:
                logger.warning("request %s failed: %s", request_id, exc)
                yield failed_output(request_id, prompt, ids, sampling_params.n, str(exc))
                return
        stream = self.add_request(
            prompt, sampling_params, request_id, priority, trace_headers, lora_request, mm_inputs
        )
        try:
            while True:
                output = await stream.get()
                if output.finished and transfer and transfer.get("do_remote_decode"):
                    assert self.kv_transfer is not None
                    output.kv_transfer_params = self.kv_transfer.export_params(request_id)
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self.core.abort(request_id) and self._wakeup is not None:
            self._wakeup.set()

    # ---- the step loop -------------------------------------------------------------------

    def _on_worker_failure(self, reason: str) -> None:
        # Called on the executor's thread: hand over to the event loop and wake the step loop.
        loop = self._loop
        if loop is None or loop.is_closed():
            self._worker_failure = reason
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(self._note_worker_failure, reason)

    def _note_worker_failure(self, reason: str) -> None:
        self._worker_failure = reason
        if self._wakeup is not None:
            self._wakeup.set()

    def _should_stop(self) -> bool:
        """The step loop's check before each step; a worker failure ends it like a failed
        step (every request fails, the server exits 1)."""
        if self._worker_failure is not None:
            raise RuntimeError(self._worker_failure)
        return self._stopping

    async def _step_loop(self) -> None:
        assert self._wakeup is not None
        try:
            await self.step_loop.run(self._wakeup, self._should_stop)
        except Exception as exc:  # a failed step: fail every request, report unhealthy
            logger.exception("step loop failed")
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            self.core.fail_all(self._dead_reason)
            self._dead.set()
            # No worker outlives a failed engine (a dead rank leaves the others blocked).
            await asyncio.to_thread(self.executor.shutdown)
