"""The engine's multimodal front end: a prompt and its images -> MultiModalInputs.

Runs where requests are made (LLM.generate, the server's handlers on a worker thread), before
the request reaches the engine: errors name the part that is wrong and cost no engine work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncserve.config import EngineConfig
from asyncserve.models.loader import LoadedModel
from asyncserve.multimodal.inputs import MultiModalFeatures, MultiModalInputs
from asyncserve.multimodal.processor import MultiModalProcessor, as_image_list, build_processor
from asyncserve.tokenizer import Tokenizer

SUPPORTED_MODALITIES = ("image",)


def image_limit(config: EngineConfig) -> int | None:
    """--limit-mm-per-prompt's image count; None when not set."""
    section = getattr(config, "multimodal", None)
    limits = getattr(section, "limit_mm_per_prompt", None) or {}
    value = limits.get("image")
    return int(value) if value is not None else None


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
