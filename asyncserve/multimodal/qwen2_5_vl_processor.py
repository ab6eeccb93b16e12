"""Qwen2.5-VL's processor: each `<|image_pad|>` (inside `<|vision_start|>...<|vision_end|>`)
expanded to its image's t*h*w / merge^2 rows; dynamic-resolution preprocessing
(models/qwen2_5_vl_image.py); the prompt's M-RoPE positions (models/mrope.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncserve.models.mrope import mrope_positions
from asyncserve.models.qwen2_5_vl import Qwen2_5_VLArch
from asyncserve.models.qwen2_5_vl_image import ImageProcessorConfig, preprocess_image
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


class Qwen2_5_VLProcessor(MultiModalProcessor):
    image_token = "<|image_pad|>"

    def __init__(self, vl: Qwen2_5_VLArch, images: ImageProcessorConfig) -> None:
        vision = vl.vision
        if (images.patch_size, images.merge_size, images.temporal_patch_size) != (
            vision.patch_size,
            vision.spatial_merge_size,
            vision.temporal_patch_size,
        ):
            raise ValueError(
                "preprocessor_config.json's patch_size / merge_size / temporal_patch_size "
                "do not match the vision config"
            )
        self.vl = vl
        self.images = images
        self.image_token_id = vl.image_token_id
        self.settings = repr(dataclasses.astuple(images))

    @classmethod
    def from_pretrained(
        cls, root: Path, arch: ArchConfig, tokenizer: Tokenizer
    ) -> Qwen2_5_VLProcessor:
        assert arch.multimodal_config is not None
        vl = Qwen2_5_VLArch.from_hf_dict(arch.multimodal_config)
        return cls(vl, ImageProcessorConfig.from_model_dir(root))

    def process(self, prompt_token_ids: list[int], images: list[Image]) -> MultiModalInputs:
        if not images:  # plain positions: M-RoPE equals RoPE without images
            expand_placeholders(prompt_token_ids, self.image_token_id, [], repr(self.image_token))
            return MultiModalInputs(list(prompt_token_ids), MultiModalFeatures())
        processed = preprocess_each(images, lambda image: preprocess_image(image, self.images))
        merge = self.images.merge_size
        lengths = [p.num_tokens(merge) for p in processed]
        ids, offsets = expand_placeholders(
            prompt_token_ids, self.image_token_id, lengths, repr(self.image_token)
        )
        items = [
            MultiModalItem(
                modality="image",
                data={
                    "pixel_values": p.pixel_values,
                    "image_grid_thw": torch.tensor(p.grid_thw, dtype=torch.int64),
                },
                offset=offset,
                length=length,
                hash=image_hash(image, self.settings),
            )
            for image, p, offset, length in zip(images, processed, offsets, lengths, strict=True)
        ]
        positions, delta = mrope_positions(
            len(ids), [(o, p.grid_thw) for o, p in zip(offsets, processed, strict=True)], merge
        )
        features = MultiModalFeatures(items, mrope_positions=positions, mrope_position_delta=delta)
        return MultiModalInputs(ids, features)
