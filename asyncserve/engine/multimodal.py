"""The engine's multimodal front end: a prompt and its images -> MultiModalInputs.

Runs where requests are made (LLM.generate, the server's handlers on a worker thread), before
the request reaches the engine: errors name the part that is wrong and cost no engine work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from asyncserve.config import EngineConfig
from asyncserve.models.loader import LoadedModel
from asyncserve.multimodal.chat_parts import (
    ContentPartError,
    ImageRef,
    refuse_typed_placeholders,
    render_with_images,
    split_image_parts,
)
from asyncserve.multimodal.inputs import MultiModalFeatures, MultiModalInputs
from asyncserve.multimodal.processor import MultiModalProcessor, as_image_list, build_processor
from asyncserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from PIL.Image import Image

    from asyncserve.multimodal.policy import MediaPolicy

SUPPORTED_MODALITIES = ("image",)


def image_limit(config: EngineConfig) -> int:
    """Most images one prompt may carry (--limit-mm-per-prompt)."""
    return config.multimodal.limit("image")


class MultiModalFrontEnd:
    def __init__(
        self,
        processor: MultiModalProcessor | None,
        tokenizer: Tokenizer,
        architecture: str,
        max_images: int | None = None,
    ) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.architecture = architecture
        self.max_images = max_images

    @classmethod
    def build(cls, loaded: LoadedModel, config: EngineConfig) -> MultiModalFrontEnd:
        processor = build_processor(loaded.arch, loaded.model_path, loaded.tokenizer)
        return cls(processor, loaded.tokenizer, loaded.arch.architecture, image_limit(config))

    @property
    def supports_images(self) -> bool:
        return self.processor is not None

    def check_image_count(self, count: int, where: str = "multi_modal_data['image']") -> None:
        if self.processor is None and count:
            raise ValueError(
                f"{where}: {self.architecture} is a text-only model and does not take images"
            )
        if self.max_images is not None and count > self.max_images:
            raise ValueError(
                f"{where}: {count} images given; at most {self.max_images} per prompt "
                "(--limit-mm-per-prompt)"
            )

    def process(self, prompt: str | list[int], mm_data: Mapping[str, Any]) -> MultiModalInputs:
        """Tokenize (a text prompt, with special tokens), expand placeholders, preprocess."""
        if not isinstance(mm_data, Mapping):
            raise ValueError(
                "multi_modal_data must be a dict such as {'image': ...}, "
                f"got {type(mm_data).__name__}"
            )
        for key in mm_data:
            if key not in SUPPORTED_MODALITIES:
                raise ValueError(
                    f"multi_modal_data[{key!r}]: modality not supported "
                    f"(supported: {', '.join(SUPPORTED_MODALITIES)})"
                )
        images = as_image_list(mm_data.get("image", []))
        self.check_image_count(len(images))
        ids = (
            self.tokenizer.encode(prompt, add_special_tokens=True)
            if isinstance(prompt, str)
            else list(prompt)
        )
        assert self.processor is not None or not images
        if self.processor is None:
            return MultiModalInputs(ids, MultiModalFeatures())
        return self.processor.process(ids, images)

    def check_text_prompt(self, prompt_token_ids: list[int]) -> None:
        """A prompt without images must not hold image placeholders."""
        if self.processor is not None and self.processor.image_token_id in prompt_token_ids:
            raise ValueError(
                f"the prompt holds the image placeholder {self.processor.image_token!r} but "
                "no image was given (multi_modal_data)"
            )

    def render_chat(
        self, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]
    ) -> tuple[str, list[ImageRef]]:
        """The chat prompt text (`render`: the chat template over messages) and the image
        parts to load, in order; the count is checked before anything is loaded."""
        placeholder = self.processor.image_token if self.processor is not None else ""
        refuse_typed_placeholders(messages, placeholder)
        messages, refs = split_image_parts(messages)
        where = refs[-1].param if refs else "messages"
        self.check_image_count(len(refs), where)
        return render_with_images(render, messages, len(refs), placeholder), refs

    def load_images(self, refs: list[ImageRef], policy: MediaPolicy) -> list[Image]:
        """Offline: each part's image (URLs read synchronously)."""
        from asyncserve.multimodal.media import load_image

        images = []
        for ref in refs:
            if ref.image is not None:
                images.append(ref.image)
                continue
            assert ref.url is not None
            try:
                images.append(load_image(ref.url, policy))
            except ValueError as exc:
                raise ContentPartError(str(exc), ref.param + ".image_url") from exc
        return images

    async def fetch_images(self, refs: list[ImageRef], policy: MediaPolicy) -> list[Image]:
        """Server: every part's image, fetched concurrently without blocking the loop."""
        from asyncserve.multimodal.media import fetch_image

        async def one(ref: ImageRef) -> Image:
            if ref.image is not None:
                return ref.image  # type: ignore[no-any-return]
            assert ref.url is not None
            try:
                return await fetch_image(ref.url, policy)
            except ValueError as exc:
                raise ContentPartError(str(exc), ref.param + ".image_url") from exc

        return list(await asyncio.gather(*(one(ref) for ref in refs)))
