"""Chat messages with image parts: the template's view and the images to load.

OpenAI clients send `{"type": "image_url", "image_url": {"url": ...}}` parts; offline
callers may also pass `{"type": "image_pil", "image_pil": PIL.Image}` (as vLLM accepts).
HF chat templates of vision models expect `{"type": "image"}` parts beside
`{"type": "text", "text": ...}` ones, and print the model's placeholder for each. A template
that only reads string content gets the text with one placeholder line per image in front
(vLLM's "string" content format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


class ContentPartError(ValueError):
    """A bad content part; `param` names it (messages[i].content[j]...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class ImageRef:
    """One image part, in message order: a URL to load, or an image already given."""

    param: str  # messages[i].content[j]
    url: str | None = None
    image: Any = None


def split_image_parts(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Messages whose image parts are `{"type": "image"}`, and the images in order. Messages
    without image parts are returned as they are."""
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content
        ):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ContentPartError("a text part needs a 'text' string", param + ".text")
                parts.append({"type": "text", "text": part["text"]})
                continue
            if kind not in IMAGE_PART_TYPES:
                raise ContentPartError(
                    f"content parts of type {kind!r} are not supported "
                    "(supported: text, image_url, image_pil)",
                    param + ".type",
                )
            refs.append(_image_ref(part, kind, param))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, refs


def refuse_typed_placeholders(messages: list[dict[str, Any]], placeholder: str) -> None:
    """Text that spells the image placeholder would stand where no image goes (or take an
    image's place): refused naming the text, before anything is loaded."""
    if not placeholder:
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        texts = [(f"messages[{i}].content", content)] if isinstance(content, str) else [
            (f"messages[{i}].content[{j}].text", part.get("text"))
            for j, part in enumerate(content if isinstance(content, list) else [])
            if isinstance(part, dict) and part.get("type") == "text"
        ]  # fmt: skip
        for param, text in texts:
            if isinstance(text, str) and placeholder in text:
                raise ContentPartError(
                    f"the text holds the image placeholder {placeholder!r}; send images "
                    "as image_url parts",
                    param,
                )


def _image_ref(part: dict[str, Any], kind: str, param: str) -> ImageRef:
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ContentPartError(
                "an image_url part needs {'url': a data: or http(s) URL}", param + ".image_url"
            )
        return ImageRef(param, url=url)
    from PIL.Image import Image

    image = part.get(kind)
    if not isinstance(image, Image):
        raise ContentPartError(f"an {kind} part needs a PIL.Image.Image", f"{param}.{kind}")
    return ImageRef(param, image=image)


def flatten_for_string_template(
    messages: list[dict[str, Any]], placeholder: str
) -> list[dict[str, Any]]:
    """Image-part messages as one string each: a placeholder line per image, then the text."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images = sum(1 for p in content if p.get("type") == "image")
            texts = [p["text"] for p in content if p.get("type") == "text"]
            content = f"{placeholder}\n" * images + "\n".join(texts)
        out.append({**message, "content": content})
    return out


def render_with_images(
    render: Callable[[list[dict[str, Any]]], str],
    messages: list[dict[str, Any]],
    num_images: int,
    placeholder: str,
) -> str:
    """The chat prompt: the template over image parts when it prints one placeholder per
    image, else over string content with the placeholders in front."""
    if num_images == 0:
        return render(messages)
    try:
        text = render(messages)
        if text.count(placeholder) == num_images:
            return text
    except ValueError:
        pass  # a template that concatenates content as a string
    return render(flatten_for_string_template(messages, placeholder))
