"""Rendering chat templates (jinja2, sandboxed) the way HF transformers does.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with only the helpers HF exposes (raise_exception,
strftime_now, a tojson that does not HTML-escape).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` (it marks assistant spans for
    training masks); for inference the body renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &), which would corrupt prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check each message and flatten list-of-parts content into one string.

    A message needs a string "role"; "content" is a string, None, or a list of
    {"type": "text", "text": str} parts, joined with newlines. Other keys pass through.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role must be a string")
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image" for p in content
        ):
            # Vision models' templates iterate over the parts themselves.
            content = _image_and_text_parts(content, i)
        elif isinstance(content, list):
            content = "\n".join(_text_parts(content, i))
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string, a list of text parts or null"
            )
        out.append({**message, "content": content})
    return out


def _image_and_text_parts(parts: list[Any], i: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "image":
            out.append({"type": "image"})
            continue
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"messages[{i}].content[{j}] must be a text or image part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        out.append({"type": "text", "text": part["text"]})
    return out


def _text_parts(parts: list[Any], i: int) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{i}].content[{j}] must be a text part, got type {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        texts.append(text)
    return texts


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text the template makes of `messages`; ValueError on any template error."""
    normalized = normalize_messages(messages)
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    try:
        compiled = _compile(template)
        return compiled.render(
            **kwargs,
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            tools=tools,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    except Exception as e:  # the template failing on these messages (None + str, say)
        raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e


def open_final_message(text: str, content: Any) -> str:
    """vLLM's continue_final_message: the rendered chat `text` cut right after the final
    message's `content` (transformers' rule), for the model to continue that message.
    `content`: a string or content parts (their text parts). ValueError when it is empty
    or the template did not render it."""
    if isinstance(content, list):  # image parts add no text of the message's
        content = "\n".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    final = content.strip() if isinstance(content, str) else ""
    if not final:
        raise ValueError("continue_final_message needs a final message with non-empty content")
    end = text.rfind(final)
    if end < 0:
        raise ValueError(
            "continue_final_message: the final message's content is not in the rendered "
            "chat template"
        )
    return text[: end + len(final)]
