"""The offline API's prompt inputs: the accepted prompt shapes, chat conversations rendered
into token prompts (images included), and the images of a prompt processed up front."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.multimodal.inputs import MultiModalInputs

PromptType = str | list[int] | dict[str, Any]


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompt_list: list[Any] = list(prompts)
    if prompt_list and all(isinstance(p, int) for p in prompt_list):
        return [prompt_list]  # one token-id prompt
    for i, p in enumerate(prompt_list):
        if not isinstance(p, str | list | dict):
            raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a dict")
    return prompt_list


def split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"]), None
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return None, list(prompt)


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


def chat_prompts(
    engine: AsyncEngine | DataParallelClient,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
) -> list[PromptType]:
    """One token prompt per conversation (one, or a list of them) through the model's chat
    template; a conversation with image parts becomes a prompt with its images."""
    conversations: list[list[dict[str, Any]]]
    if messages and isinstance(messages[0], dict):
        conversations = [messages]  # type: ignore[list-item]
    else:
        conversations = messages  # type: ignore[assignment]
    tokenizer = engine.tokenizer
    prompts: list[PromptType] = []
    front_end = getattr(engine, "multimodal", None)
    for conversation in conversations:

        def render(messages: list[dict[str, Any]]) -> str:
            return tokenizer.apply_chat_template(  # type: ignore[no-any-return]
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **(chat_template_kwargs or {}),
            )

        if front_end is None:
            text, images = render(conversation), []
        else:
            # Image parts (image_url, image_pil) become the template's image parts.
            text, refs = front_end.render_chat(conversation, render)
            images = front_end.load_images(refs, engine.config.multimodal.media_policy())
        # The template already holds BOS where the model wants one.
        ids = tokenizer.encode(text, add_special_tokens=False)
        if images:
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
        else:
            prompts.append(ids)
    return prompts
