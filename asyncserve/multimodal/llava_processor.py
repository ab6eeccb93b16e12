"""LLaVA's processor: `<image>` expanded to the image's embedding rows; CLIP preprocessing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncserve.models.llava import LlavaArch
from asyncserve.multimodal.image_processing import ImageProcessor
from asyncserve.multimodal.inputs import (
    MultiModalFeatures,
    MultiModalInputs,
    MultiModalItem,
    image_hash,
)
from asyncserve.multimodal.processor import (
    MultiModalProcessor,
    expand_placeholders,
    preprocess_each,
)

if TYPE_CHECKING:
    from PIL.Image import Image

    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.tokenizer import Tokenizer


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


class LlavaProcessor(MultiModalProcessor):
    def __init__(
        self, llava: LlavaArch, images: ImageProcessor, image_token: str, image_token_id: int
    ) -> None:
        self.llava = llava
        self.images = images
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.num_image_tokens = llava.num_image_tokens

    @classmethod
    def from_pretrained(cls, root: Path, arch: ArchConfig, tokenizer: Tokenizer) -> LlavaProcessor:
        assert arch.multimodal_config is not None
        llava = LlavaArch.from_hf_dict(arch.multimodal_config)
        images = ImageProcessor.from_dict(
            _read(root / "preprocessor_config.json"), llava.vision.image_size
        )
        crop = images.crop_size or images.size
        if crop.get("height", llava.vision.image_size) != llava.vision.image_size:
            raise ValueError(
                f"the image processor's output size {crop} does not match the vision "
                f"tower's image_size {llava.vision.image_size}"
            )
        token = str(_read(root / "processor_config.json").get("image_token") or "<image>")
        return cls(llava, images, token, llava.image_token_id)

    def process(self, prompt_token_ids: list[int], images: list[Image]) -> MultiModalInputs:
        lengths = [self.num_image_tokens] * len(images)
        ids, offsets = expand_placeholders(
            prompt_token_ids, self.image_token_id, lengths, repr(self.image_token)
        )
        settings = self.images.settings()
        pixels = preprocess_each(images, self.images)
        items = [
            MultiModalItem(
                modality="image",
                data={"pixel_values": values},
                offset=offset,
                length=length,
                hash=image_hash(image, settings),
            )
            for image, values, offset, length in zip(images, pixels, offsets, lengths, strict=True)
        ]
        return MultiModalInputs(ids, MultiModalFeatures(items))
