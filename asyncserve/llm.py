"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from asyncserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from asyncserve.config import DEFAULT_DECODE_LATENCY_TARGET_MS, EngineConfig, Environment
from asyncserve.config.sections import offline_batch_limits
from asyncserve.config.typecheck import check_value
from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.engine.dp_group import DataParallelGroup
from asyncserve.gc_heap import freeze_startup_heap, thaw_startup_heap
from asyncserve.llm_prompts import (
    ImageWork,
    as_prompt_list,
    chat_prompts,
    check_params,
    loras_per_prompt,
    params_per_prompt,
    priorities_per_prompt,
    split_prompt,
)
from asyncserve.llm_prompts import PromptType as PromptType
from asyncserve.lora.request import LoRARequest
from asyncserve.offline_loop import run_call
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.pooling.config import resolve_runner
from asyncserve.pooling.engine import PoolingEngine
from asyncserve.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from asyncserve.sampling_params import MODEL_SAMPLING_DEFAULTS, RequestOutputKind, SamplingParams
from asyncserve.tokenizer import Tokenizer


class LLM:
    """A model loaded for batch generation. Arguments are named as vLLM names them."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "auto",
        runner: str = "auto",
        quantization: str | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        scheduling_policy: str = "fcfs",
        async_scheduling: bool | None = None,
        enforce_eager: bool = False,
        max_cudagraph_capture_size: int = 512,
        tensor_parallel_size: int = 1,
        otlp_traces_endpoint: str | None = None,
        collect_detailed_traces: str | None = None,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        disable_custom_all_reduce: bool = False,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        ray_placement_strategy: str = "STRICT_PACK",
        max_logprobs: int = 20,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        decode_latency_target_ms: float = DEFAULT_DECODE_LATENCY_TARGET_MS,
        speculative_config: dict[str, Any] | None = None,
        allowed_media_domains: list[str] | None = None,
        limit_mm_per_prompt: dict[str, Any] | None = None,
    ) -> None:
        """`data_parallel_size` > 1: that many engine replicas in their own processes (each on
        its own tensor_parallel_size devices); generate() spreads the prompts over them.
        Under a data-parallel launcher (ASYNCSERVE_DP_RANK / _SIZE / _MASTER_IP /
        _MASTER_PORT set) this process is one rank: it joins the ranks' group and runs one
        engine on its own prompts."""
        # Most logprobs (and prompt_logprobs) a SamplingParams may ask for; -1: no cap (vLLM's).
        check_value("max_logprobs", max_logprobs, int)
        self.max_logprobs = max_logprobs
        # Unset, the batch limits are offline's: larger than serving's on a GPU.
        on_gpu = str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        max_num_seqs, max_num_batched_tokens = offline_batch_limits(
            max_num_seqs, max_num_batched_tokens, on_gpu
        )
        config = EngineConfig.from_engine_args(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            load_format=load_format,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
            runner=runner,
            quantization=quantization,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory=kv_cache_memory,
            num_gpu_blocks_override=num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=scheduling_policy,
            async_scheduling=async_scheduling,
            enforce_eager=enforce_eager,
            max_cudagraph_capture_size=max_cudagraph_capture_size,
            tensor_parallel_size=tensor_parallel_size,
            otlp_traces_endpoint=otlp_traces_endpoint,
            collect_detailed_traces=collect_detailed_traces,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            data_parallel_size=data_parallel_size,
            decode_latency_target_ms=decode_latency_target_ms,
            enable_expert_parallel=enable_expert_parallel,
            disable_custom_all_reduce=disable_custom_all_reduce,
            speculative_config=speculative_config,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            ray_placement_strategy=ray_placement_strategy,
            allowed_media_domains=allowed_media_domains,
            limit_mm_per_prompt=limit_mm_per_prompt,
        )
        place = Environment.read().dp_rank
        self._dp_group: DataParallelGroup | None = None
        if place is not None and place.size > 1:
            if data_parallel_size > 1:
                raise ValueError(
                    "data_parallel_size: give it or ASYNCSERVE_DP_SIZE (a launcher's ranks), "
                    "not both"
                )
            self._dp_group = DataParallelGroup(place)
        self._engine: AsyncEngine | DataParallelClient | None = None
        self._pooling: PoolingEngine | None = None
        model_dir = Path(model) if model is not None and Path(model).is_dir() else None
        if resolve_runner(runner, model_dir) == "pooling":
            if data_parallel_size > 1:
                raise ValueError("data_parallel_size: pooling models run on one engine")
            self._pooling = PoolingEngine.from_config(config)
        elif data_parallel_size > 1:
            self._engine = DataParallelClient(config)
        else:
            self._engine = AsyncEngine.from_config(config)
        if self._dp_group is not None:
            self._dp_group.barrier()  # every rank has loaded before any generates
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        # The engine shares this process: its start-up heap (torch, the model, the caller's
        # objects) leaves the collector's view, so the full collections a long generate()
        # sets off walk only what it allocates (W1b on an H200: 12 device idle gaps of ~60
        # ms each before). Undone by close().
        self._gc_thresholds = gc.get_threshold()
        freeze_startup_heap()

    @property
    def engine(self) -> AsyncEngine | DataParallelClient:
        """The generating engine; a pooling model has none (use embed() and score())."""
        if self._engine is None:
            raise ValueError(
                "this LLM runs a pooling model (runner='pooling'): use embed() or score()"
            )
        return self._engine

    def get_tokenizer(self) -> Tokenizer:
        if self._pooling is not None:
            return self._pooling.tokenizer
        return self.engine.tokenizer

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One pooled vector per prompt (normalized if the model says so), in input order."""
        pooling = self._pooling_engine()
        items: list[str | list[int]] = []
        for prompt in as_prompt_list(prompts):
            text, prompt_ids = split_prompt(prompt)
            items.append(prompt_ids if prompt_ids is not None else text or "")
        vectors, ids = run_call(
            self._loop, pooling.embed_inputs(items, truncate_prompt_tokens=truncate_prompt_tokens)
        )
        return [
            EmbeddingRequestOutput(str(next(self._ids)), tokens, EmbeddingOutput(vec.tolist()))
            for vec, tokens in zip(vectors, ids, strict=True)
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's encode() for the "embed" task: embed()'s vectors as tensors."""
        if pooling_task not in (None, "embed"):
            raise ValueError(f"pooling_task: only 'embed' is supported, got {pooling_task!r}")
        if pooling_params is not None:
            raise ValueError("pooling_params: not supported; the model's pooler applies")
        return [
            PoolingRequestOutput(
                o.request_id, PoolingOutput(torch.tensor(o.outputs.embedding)), o.prompt_token_ids
            )
            for o in self.embed(prompts, truncate_prompt_tokens)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of data_2's texts to data_1 (one text for all, or one each): a
        cross-encoder's score, or an embedding model's cosine similarity."""
        pooling = self._pooling_engine()
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        scores, _ = run_call(self._loop, pooling.score(firsts, seconds, truncate_prompt_tokens))
        return [ScoringRequestOutput(str(next(self._ids)), [], ScoringOutput(s)) for s in scores]

    def _check_generates(self) -> None:
        if self._loop.is_closed():  # not the event loop's own "Event loop is closed"
            raise RuntimeError("this LLM is closed: LLM.close() was called")
        self.engine  # noqa: B018 - raises the ValueError for a pooling model

    def _pooling_engine(self) -> PoolingEngine:
        if self._loop.is_closed():
            raise RuntimeError("this LLM is closed: LLM.close() was called")
        if self._pooling is None:
            raise ValueError(
                "embed(), encode() and score() need a pooling model: LLM(model, runner='pooling')"
            )
        return self._pooling

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults, as vLLM applies them."""
        gen = self.engine.generation_config
        return SamplingParams(**{k: gen[k] for k in MODEL_SAMPLING_DEFAULTS if k in gen})

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]},
        a dict optionally with "multi_modal_data": {"image": PIL image or list of them}.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt.
        """
        self._check_generates()
        prompt_list = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = params_per_prompt(sampling_params, len(prompt_list))
        check_params(self.engine, prompt_list, params_list, self.max_logprobs)
        priorities = priorities_per_prompt(priority, len(prompt_list))
        # A bad adapter is the caller's error: raise before any work.
        loras = loras_per_prompt(lora_request, len(prompt_list))
        for lora in {id(r): r for r in loras if r is not None}.values():
            self._lora_engine().add_lora(lora)
        # Images are processed on threads while the engine runs the prompts ready before
        # them; a bad one raises its ValueError and the call's other requests are aborted.
        images = ImageWork(self.engine, prompt_list)
        try:
            return run_call(
                self._loop,
                self._run_all(prompt_list, params_list, priorities, use_tqdm, loras, images),
            )
        finally:
            images.close()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validate and register an adapter ahead of its first request."""
        return self._lora_engine().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_engine().remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return [r.lora_int_id for r in self._lora_engine().list_loras()]

    def _lora_engine(self) -> AsyncEngine | DataParallelClient:
        engine = self.engine
        if not isinstance(engine, AsyncEngine | DataParallelClient):
            raise ValueError("lora_request: LoRA adapters need a generating model")
        return engine

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate; `tools`
        (OpenAI's shape) reach the template as its `tools` variable, as in vLLM.
        `continue_final_message` (with add_generation_prompt=False): the model continues the
        final message instead of starting a new turn."""
        self._check_generates()
        prompts = chat_prompts(
            self.engine, messages, add_generation_prompt, chat_template_kwargs, tools,
            continue_final_message,
        )  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as vLLM's LLM.beam_search (see asyncserve.beam_search).

        Each sequence's tokens and text include the prompt; sequences are sorted best first.
        """
        self._check_generates()
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        token_prompts: list[list[int]] = []
        for prompt in as_prompt_list(prompts):
            text, ids = split_prompt(prompt)
            if ids is None:
                ids = self.engine.tokenizer.encode(text or "", add_special_tokens=True)
            token_prompts.append(ids)
        prefix = f"beam-{next(self._ids)}"
        return run_call(self._loop, beam_search(self.engine, token_prompts, params, prefix))

    async def _run_all(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
        images: ImageWork | None = None,
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        # None without a bar: even a disabled tqdm starts its monitor thread (ms a call).
        progress = tqdm(total=len(prompts), desc="Processed prompts") if use_tqdm else None

        async def run_one(index: int) -> None:
            prompt = prompts[index]
            params = params_list[index]
            final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            text, ids = split_prompt(prompt)
            # A bad image is the call's ValueError (raised past the per-request errors below).
            mm = await images.get(index) if images is not None else None
            request_id = str(next(self._ids))
            engine_prompt: str | list[int] = ids if ids is not None else (text or "")
            try:
                lora = loras[index] if loras is not None else None
                kwargs = {"mm_inputs": mm} if mm is not None else {}
                async for output in self.engine.generate(
                    engine_prompt,
                    final,
                    request_id,
                    priorities[index],
                    lora_request=lora,
                    **kwargs,  # type: ignore[arg-type]
                ):
                    results[index] = output
            except ValueError as exc:
                results[index] = _error_output(request_id, text, ids or [], str(exc), params.n)
            if results[index] is not None and text is not None:
                results[index].prompt = text  # type: ignore[union-attr]
            if progress is not None:
                progress.update(1)

        tasks = [asyncio.ensure_future(run_one(i)) for i in range(len(prompts))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # One failed (a bad image): the others' requests are aborted, not left running.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [r for r in results if r is not None]

    def close(self) -> None:
        if not self._loop.is_closed():
            thaw_startup_heap(self._gc_thresholds)  # first: closing collects the engine's cycles
            engine = self._pooling if self._pooling is not None else self._engine
            if engine is not None:
                self._loop.run_until_complete(engine.close())
            self._loop.close()
        if self._dp_group is not None:
            self._dp_group.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _error_output(
    request_id: str, prompt: str | None, ids: list[int], error: str, n: int
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=ids,
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
            for i in range(n)
        ],
        finished=True,
        error=error,
    )
