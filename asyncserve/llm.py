"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from asyncserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from asyncserve.config import EngineConfig
from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import MODEL_SAMPLING_DEFAULTS, RequestOutputKind, SamplingParams
from asyncserve.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """A model loaded for batch generation. Arguments are named as vLLM names them."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "auto",
        quantization: str | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        scheduling_policy: str = "fcfs",
        async_scheduling: bool | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        max_logprobs: int = 20,
    ) -> None:
        # Most logprobs (and prompt_logprobs) a SamplingParams may ask for, as in vLLM.
        self.max_logprobs = max_logprobs
        config = EngineConfig.from_engine_args(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            load_format=load_format,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
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
            tensor_parallel_size=tensor_parallel_size,
        )
        self.engine = AsyncEngine.from_config(config)
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts"
                )
        for params in params_list:
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > self.max_logprobs:
                    raise ValueError(
                        f"{name}: requested {value}, which is greater than max allowed: "
                        f"{self.max_logprobs} (LLM(max_logprobs=...))"
                    )
            if params.structured_outputs is not None:
                # A bad schema, regex or grammar is the caller's error: raise before any work.
                self.engine.structured.validate(params.structured_outputs)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        return self._loop.run_until_complete(
            self._run_all(prompt_list, params_list, priorities, use_tqdm)
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        conversations: list[list[dict[str, Any]]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        tokenizer = self.engine.tokenizer
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # The template already holds BOS where the model wants one.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as vLLM's LLM.beam_search (see asyncserve.beam_search).

        Each sequence's tokens and text include the prompt; sequences are sorted best first.
        """
        token_prompts: list[list[int]] = []
        for prompt in _as_prompt_list(prompts):
            text, ids = _split_prompt(prompt)
            if ids is None:
                ids = self.engine.tokenizer.encode(text or "", add_special_tokens=True)
            token_prompts.append(ids)
        prefix = f"beam-{next(self._ids)}"
        return self._loop.run_until_complete(
            beam_search(self.engine, token_prompts, params, prefix)
        )

    async def _run_all(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        progress = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)

        async def run_one(index: int) -> None:
            prompt = prompts[index]
            params = params_list[index]
            final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            text, ids = _split_prompt(prompt)
            request_id = str(next(self._ids))
            engine_prompt: str | list[int] = ids if ids is not None else (text or "")
            try:
                async for output in self.engine.generate(
                    engine_prompt, final, request_id, priorities[index]
                ):
                    results[index] = output
            except ValueError as exc:
                results[index] = _error_output(request_id, text, ids or [], str(exc), params.n)
            if results[index] is not None and text is not None:
                results[index].prompt = text  # type: ignore[union-attr]
            progress.update(1)

        try:
            await asyncio.gather(*(run_one(i) for i in range(len(prompts))))
        finally:
            progress.close()
        return [r for r in results if r is not None]

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.engine.close())
            self._loop.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompt_list: list[Any] = list(prompts)
    if prompt_list and all(isinstance(p, int) for p in prompt_list):
        return [prompt_list]  # one token-id prompt
    for i, p in enumerate(prompt_list):
        if not isinstance(p, str | list | dict):
            raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a dict")
    return prompt_list


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"]), None
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return None, list(prompt)


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
