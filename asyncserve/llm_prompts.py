"""The offline API's prompt inputs: the accepted prompt shapes, chat conversations rendered
into token prompts (images included), and the images of a prompt processed up front."""

from __future__ import annotations

import asyncio
import numbers
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncserve.chat_template import open_final_message
from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.engine.request_checks import (
    check_logprobs,
    check_min_tokens,
    check_priority,
    check_token_params,
    check_truncation,
    truncate_prompt,
)
from asyncserve.lora.request import LoRARequest
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """The prompts as a list, each checked for its shape (a bad one is a ValueError before
    any work, not an error from inside the engine)."""
    if isinstance(prompts, str | dict):
        prompt_list: list[Any] = [prompts]
    elif isinstance(prompts, Iterable) and not isinstance(prompts, bytes):
        prompt_list = list(prompts)
        if prompt_list and all(_is_token_id(p) for p in prompt_list):
            prompt_list = [prompt_list]  # one token-id prompt
    else:
        raise ValueError(
            "prompts must be a string, a list of token ids, a dict or a list of them, "
            f"got {type(prompts).__name__}"
        )
    for i, p in enumerate(prompt_list):
        if not isinstance(p, str | list | dict):
            raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a dict")
        split_prompt(p, f"prompts[{i}]")
    return prompt_list


def params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams for every prompt, or one each; anything else is a ValueError
    naming it (not an AttributeError from the checks that read them)."""
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, Iterable) or isinstance(sampling_params, str | dict):
        raise ValueError(
            "sampling_params must be a SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(f"sampling_params: got {len(params_list)} for {num_prompts} prompts")
    for i, params in enumerate(params_list):
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}"
            )
    return params_list


def check_params(
    engine: AsyncEngine | DataParallelClient,
    prompts: list[PromptType],
    params_list: list[SamplingParams],
    max_logprobs: int,
) -> None:
    """The checks of a generate() call's params that raise before any work: a bad one is
    the caller's error, not one request's failed output."""
    vocab_size = engine.loaded.arch.vocab_size
    max_model_len = engine.max_model_len
    checked: set[int] = set()  # one SamplingParams for every prompt is checked once
    for prompt, params in zip(prompts, params_list, strict=True):
        if id(params) not in checked:
            checked.add(id(params))
            check_logprobs(params, max_logprobs, vocab_size)
            check_token_params(params, vocab_size)
            if params.truncate_prompt_tokens is not None:
                check_truncation(params.truncate_prompt_tokens, max_model_len)
            if params.structured_outputs is not None:
                # A bad schema, regex or grammar, or allowed_token_ids that leave it nothing.
                engine.structured.validate(params.structured_outputs, params.allowed_token_ids)
        if params.min_tokens and not _has_images(prompt):
            # An image prompt's length is known once its images are processed: the
            # engine's own check fails that request alone.
            text, ids = split_prompt(prompt)
            if ids is None:
                ids = engine.tokenizer.encode(text or "", add_special_tokens=True)
            ids = truncate_prompt(ids, params, max_model_len)
            if len(ids) < max_model_len:  # a longer prompt fails as the engine words it
                check_min_tokens(len(ids), params, max_model_len)


def priorities_per_prompt(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    """One integer priority per prompt (0 for all without)."""
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, Iterable) or isinstance(priority, str | bytes | dict):
        raise ValueError(f"priority must be a list of integers, got {type(priority).__name__}")
    priorities = list(priority)
    if len(priorities) != num_prompts:
        raise ValueError(f"priority: got {len(priorities)} values for {num_prompts} prompts")
    for value in priorities:
        check_priority(value)
    return priorities


def loras_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: `lora_request` for every prompt, or one each."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str | bytes):
        raise ValueError(
            "lora_request must be a LoRARequest, a list of them or None, got "
            + type(lora_request).__name__
        )
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request: got {len(loras)} for {num_prompts} prompts")
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None")
    return loras


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(ids: Any, where: str) -> list[int]:
    if isinstance(ids, str | bytes | dict) or not isinstance(ids, Iterable):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    out = list(ids)
    if all(type(t) is int for t in out):  # the common case, ~30x faster than the checks below
        return out
    for i, token in enumerate(out):
        if not _is_token_id(token):
            raise ValueError(f"{where}[{i}] must be a token id (an integer), got {token!r}")
    return [int(t) for t in out]


def split_prompt(prompt: PromptType, where: str = "prompt") -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt; a ValueError names what is wrong with its shape."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
        if text is not None:
            return text, None
        raise ValueError(f"{where}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return None, _token_ids(prompt, where)


def multimodal_inputs(
    engine: AsyncEngine | DataParallelClient, prompt: PromptType
) -> MultiModalInputs | None:
    """The processed images of a prompt with "multi_modal_data" (None without)."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return None
    front_end = getattr(engine, "multimodal", None)
    if front_end is None:
        raise ValueError("multi_modal_data is not supported by this engine")
    text, ids = split_prompt(prompt)
    source: str | list[int] = ids if ids is not None else (text or "")
    return front_end.process(source, prompt["multi_modal_data"])  # type: ignore[no-any-return]


# Threads that preprocess a generate() call's images: PIL's resampling, numpy's arithmetic and
# hashing release the GIL, so images of different prompts are processed at once.
_IMAGE_WORKERS = 8


class ImageWork:
    """The image prompts of one generate() call, preprocessed on up to _IMAGE_WORKERS threads
    while the engine already runs the prompts done before them. `get(i)` waits for prompt i's
    MultiModalInputs (None without images) and raises its ValueError when it is bad."""

    def __init__(self, engine: AsyncEngine | DataParallelClient, prompts: list[PromptType]):
        self._futures: list[Future[MultiModalInputs | None] | None] = [None] * len(prompts)
        indexes = [i for i, p in enumerate(prompts) if _has_images(p)]
        self._pool: ThreadPoolExecutor | None = None
        if indexes:
            workers = min(_IMAGE_WORKERS, os.cpu_count() or 1, len(indexes))
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="asyncserve-images")
            for i in indexes:
                self._futures[i] = self._pool.submit(multimodal_inputs, engine, prompts[i])

    async def get(self, index: int) -> MultiModalInputs | None:
        future = self._futures[index]
        return None if future is None else await asyncio.wrap_future(future)

    def results(self) -> list[MultiModalInputs | None]:
        """Every prompt's inputs, waiting for all (the first bad prompt's ValueError)."""
        return [f.result() if f is not None else None for f in self._futures]

    def close(self) -> None:
        """Drop the work not started (the call failed or ended)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _has_images(prompt: PromptType) -> bool:
    return isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None


def _check_tools(tools: Any) -> None:
    """`tools` as the HTTP route takes them: a list of tool objects (dicts)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of objects, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object (a dict), got {type(tool).__name__}")


def chat_prompts(
    engine: AsyncEngine | DataParallelClient,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    continue_final_message: bool = False,
) -> list[PromptType]:
    """One token prompt per conversation (one, or a list of them) through the model's chat
    template; a conversation with image parts becomes a prompt with its images.
    `continue_final_message` (vLLM's): the final message stays open, for the model to
    continue it rather than start a new turn."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(
            "chat_template_kwargs must be a dict, got " + type(chat_template_kwargs).__name__
        )
    for key in chat_template_kwargs or {}:
        if not isinstance(key, str):  # they become the template's variables, named by keys
            raise ValueError(f"chat_template_kwargs keys must be strings, got {key!r}")
    for reserved in ("messages", "bos_token", "eos_token"):
        if reserved in (chat_template_kwargs or {}):
            raise ValueError(f"chat_template_kwargs must not set {reserved!r}")
    _check_tools(tools)
    # As in vLLM, chat_template_kwargs override the arguments (add_generation_prompt, tools).
    template_kwargs = {
        "add_generation_prompt": add_generation_prompt,
        "tools": tools,
        **(chat_template_kwargs or {}),
    }
    continue_final = template_kwargs.pop("continue_final_message", continue_final_message)
    _check_continue_final(continue_final, template_kwargs["add_generation_prompt"])
    conversations: list[list[dict[str, Any]]]
    if messages and isinstance(messages[0], dict):
        conversations = [messages]  # type: ignore[list-item]
    else:
        conversations = messages  # type: ignore[assignment]
    if not isinstance(conversations, list | tuple) or not conversations:
        raise ValueError("messages must contain at least one message")
    # As the HTTP route: an empty conversation is the caller's error, not an empty prompt.
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, list | tuple) or not conversation:
            raise ValueError(f"messages[{i}] must contain at least one message")
    where = "messages" if len(conversations) == 1 else "messages[{}]"
    conversations = [_with_content(list(c), where.format(i)) for i, c in enumerate(conversations)]
    tokenizer = engine.tokenizer
    prompts: list[PromptType] = []
    front_end = getattr(engine, "multimodal", None)
    for conversation in conversations:

        def render(messages: list[dict[str, Any]]) -> str:
            return tokenizer.apply_chat_template(messages, **template_kwargs)  # type: ignore[no-any-return]

        if front_end is None:
            text, images = render(conversation), []
        else:
            # Image parts (image_url, image_pil) become the template's image parts.
            text, refs = front_end.render_chat(conversation, render)
            images = front_end.load_images(refs, engine.config.multimodal.media_policy())
        if continue_final:
            text = open_final_message(text, conversation[-1].get("content"))
        # The template already holds BOS where the model wants one.
        ids = tokenizer.encode(text, add_special_tokens=False)
        if images:
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
        else:
            prompts.append(ids)
    return prompts


def _with_content(conversation: list[Any], where: str) -> list[Any]:
    """The messages with a content each, as the HTTP route has them: an assistant turn that
    only calls tools may leave it out (null; the templates concatenate it, so it becomes
    ""), any other message must give it."""
    out: list[Any] = []
    for i, message in enumerate(conversation):
        if isinstance(message, dict) and message.get("content") is None:
            if message.get("role") != "assistant":
                raise ValueError(
                    f"{where}[{i}].content must be given (only an assistant message that "
                    "calls tools may leave it out)"
                )
            message = {**message, "content": ""}
        out.append(message)
    return out


def _check_continue_final(continue_final: Any, add_generation_prompt: Any) -> None:
    if not isinstance(continue_final, bool):
        raise ValueError(
            f"continue_final_message must be a boolean, got {type(continue_final).__name__}"
        )
    if continue_final and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "pass add_generation_prompt=False to continue the final message"
        )
