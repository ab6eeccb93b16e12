"""Image parts of a chat request: checked, then fetched on the event loop (data: URLs decoded
in a thread, http(s) URLs under the --allowed-media-domains policy), before the prompt is
rendered and processed in the preprocessing pool. Every refusal is a 400 naming the part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncserve.http.chat_prompt import messages_to_dicts
from asyncserve.http.errors import APIError
from asyncserve.http.protocol import ChatCompletionRequest
from asyncserve.multimodal.chat_parts import (
    ContentPartError,
    refuse_typed_placeholders,
    split_image_parts,
)
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.multimodal.processor import ImageError

if TYPE_CHECKING:
    from PIL.Image import Image

    from asyncserve.engine.multimodal import MultiModalFrontEnd


@dataclass
class ChatImages:
    """The messages as the template sees them and the images, in part order."""

    messages: list[dict[str, Any]]
    images: list[Image] = field(default_factory=list)
    front_end: MultiModalFrontEnd | None = None
    # Each image's part (messages[i].content[j]...), for errors about one image.
    params: list[str] = field(default_factory=list)

    @property
    def placeholder(self) -> str:
        processor = self.front_end.processor if self.front_end is not None else None
        return processor.image_token if processor is not None else ""

    def process(self, prompt_token_ids: list[int]) -> MultiModalInputs | None:
        """Placeholders expanded, images preprocessed (blocking: in the pool); None
        without images."""
        if not self.images:
            return None
        assert self.front_end is not None
        try:
            return self.front_end.process(prompt_token_ids, {"image": self.images})
        except ImageError as exc:
            param = self.params[exc.index] if exc.index < len(self.params) else "messages"
            raise APIError(f"{param}: {exc.__cause__ or exc}", 400, param) from exc
        except ValueError as exc:
            raise APIError(str(exc), 400, "messages") from exc


async def load_chat_images(engine: Any, body: ChatCompletionRequest) -> ChatImages:
    messages = messages_to_dicts(body.messages)
    front_end: MultiModalFrontEnd | None = getattr(engine, "multimodal", None)
    if front_end is None:
        _refuse_image_parts(messages, "images are not supported by this engine")
    elif not front_end.supports_images:
        reason = f"{front_end.architecture} is a text-only model and does not take images"
        _refuse_image_parts(messages, reason)
    try:
        if front_end is not None and front_end.processor is not None:
            refuse_typed_placeholders(messages, front_end.processor.image_token)
        messages, refs = split_image_parts(messages)
    except ContentPartError as exc:
        raise APIError(str(exc), 400, exc.param) from exc
    if not refs:
        return ChatImages(messages)
    config = getattr(engine, "config", None)
    if front_end is None or config is None:
        raise APIError("images are not supported by this server's engine", 400, refs[0].param)
    try:
        # Nothing is fetched for a prompt that cannot take its images.
        front_end.check_image_count(len(refs), refs[-1].param)
        images = await front_end.fetch_images(refs, config.multimodal.media_policy())
    except ContentPartError as exc:
        raise APIError(str(exc), 400, exc.param) from exc
    except ValueError as exc:
        raise APIError(str(exc), 400, refs[-1].param) from exc
    params = [ref.param + (".image_url" if ref.url is not None else "") for ref in refs]
    return ChatImages(messages, images, front_end, params)


def _refuse_image_parts(messages: list[dict[str, Any]], reason: str) -> None:
    """No images here: the first non-text part is a 400 naming its type."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") != "text":
                raise APIError(
                    f"content parts of type {part.get('type')!r} are not supported: {reason}",
                    400,
                    f"messages[{i}].content[{j}].type",
                )
