"""Chat messages -> the prompt text, through the model's chat template.

The template itself is the tokenizer's (`tokenizer.apply_chat_template`); this module checks
the messages, flattens text content parts, and implements vLLM's `continue_final_message`
(the final message stays open, so the model continues it instead of starting a new turn).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from asyncserve.chat_template import open_final_message
from asyncserve.http.errors import APIError
from asyncserve.http.protocol import ChatCompletionRequest, ChatMessage
from asyncserve.multimodal.chat_parts import render_with_images

if TYPE_CHECKING:
    from asyncserve.http.chat_images import ChatImages


def _message_text(message: ChatMessage, index: int) -> str | list[dict[str, Any]] | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    if any(part.type == "image_url" for part in content):
        # The parts as sent; chat_images.py checks them and turns images into template parts.
        return [msgspec.to_builtins(part) for part in content]
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(
                f"content parts of type {part.type!r} are not supported; only 'text' is",
                400,
                f"messages[{index}].content[{j}].type",
            )
        if part.text is None:
            raise APIError(
                "a text content part needs a 'text' field",
                400,
                f"messages[{index}].content[{j}].text",
            )
        texts.append(part.text)
    return "\n".join(texts)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template sees them: role, content (a string) and tool fields."""
    if not messages:
        raise APIError("messages must contain at least one message", 400, "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not message.role:
            raise APIError("role must be a non-empty string", 400, f"messages[{i}].role")
        content = _message_text(message, i)
        if content is None and message.role != "assistant":
            raise APIError("content must be given", 400, f"messages[{i}].content")
        # An assistant turn that only calls tools has no content; templates concatenate it.
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = _template_tool_calls(message.tool_calls, i)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Tool calls as HF templates read them: arguments an object, not OpenAI's JSON text
    (vLLM does the same); arguments that are not a JSON object stay as sent."""
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise APIError(
                "a tool call must be an object", 400, f"messages[{index}].tool_calls[{j}]"
            )
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


# Set by the server (or, for chat_template, by the model), or names of the renderer's own
# parameters (Tokenizer.apply_chat_template's self, render_chat_template's template): never
# by a request.
_RESERVED_KWARGS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "chat_template",
    "bos_token",
    "eos_token",
    "self",
    "template",
)


def _add_generation_prompt(body: ChatCompletionRequest) -> bool:
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                400,
                "continue_final_message",
            )
        return False
    return True if body.add_generation_prompt is None else body.add_generation_prompt


def render_chat_prompt(
    tokenizer: Any,
    body: ChatCompletionRequest,
    chat_template: str | None = None,
    images: ChatImages | None = None,
) -> str:
    """The prompt text for a chat request (raises APIError naming the field on bad input);
    `chat_template`: the server's --chat-template, used instead of the tokenizer's;
    `images`: the messages with image parts (chat_images.py)."""
    messages = messages_to_dicts(body.messages) if images is None else images.messages
    add_generation_prompt = _add_generation_prompt(body)
    kwargs = dict(body.chat_template_kwargs or {})
    for reserved in _RESERVED_KWARGS:
        if reserved in kwargs:
            raise APIError(
                f"chat_template_kwargs must not set {reserved!r}", 400, "chat_template_kwargs"
            )
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    tools = [msgspec.to_builtins(t) for t in body.tools] if body.tools else None

    def render(view: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(  # type: ignore[no-any-return]
            view, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )

    try:
        if images is not None and images.images:
            text = render_with_images(render, messages, len(images.images), images.placeholder)
        else:
            text = render(messages)
    except ValueError as exc:
        raise APIError(f"the chat template could not be applied: {exc}", 400, "messages") from exc
    except Exception as exc:  # a template raising on these messages (jinja2 errors and the like)
        raise APIError(
            f"the chat template could not be applied: {type(exc).__name__}: {exc}", 400, "messages"
        ) from exc
    if not isinstance(text, str):
        raise APIError("the chat template did not produce text", 400, "messages")
    if body.continue_final_message:
        text = _open_final_message(text, messages)
    return text


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """chat_template.open_final_message, its ValueError a 400 naming the final content."""
    try:
        return open_final_message(text, messages[-1].get("content"))
    except ValueError as exc:
        raise APIError(str(exc), 400, f"messages[{len(messages) - 1}].content") from None
