"""Qwen2-VL / Qwen2.5-VL image preprocessing: PIL image -> flattened patches + grid (t, h, w).

The same steps, in the same arithmetic, as transformers' Qwen2-VL image processor (PIL
backend): RGB, resize with PIL bicubic to `smart_resize`'s size (multiples of patch x merge,
pixel count within [min_pixels, max_pixels], aspect ratio kept), scale by 1/255 in float64 then
float32, normalise with the CLIP mean / std, and flatten into patches ordered merge group by
merge group, each patch repeated `temporal_patch_size` times (a still image is a 2-frame clip).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ImageProcessorConfig:
        """preprocessor_config.json's fields (min/max pixels directly or as size's
        shortest_edge / longest_edge, as the two HF spellings have them)."""
        size = d.get("size") or {}
        default = cls()
        return cls(
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
            patch_size=int(d.get("patch_size", default.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(d.get("merge_size", default.merge_size)),
            image_mean=tuple(float(x) for x in d.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(x) for x in d.get("image_std", CLIP_STD)),
            rescale_factor=float(d.get("rescale_factor", default.rescale_factor)),
        )

    @classmethod
    def from_model_dir(cls, root: Path | None) -> ImageProcessorConfig:
        path = None if root is None else root / "preprocessor_config.json"
        if path is None or not path.is_file():
            return cls()
        return cls.from_hf_dict(json.loads(path.read_text()))


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The resized (height, width): multiples of factor, area within [min_pixels,
    max_pixels], aspect ratio kept as closely as that allows."""
    if min(height, width) < 1:
        raise ValueError(f"image has no pixels: {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is over "
            f"{MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [t * h * w, C * temporal_patch_size * patch^2] float32
    grid_thw: tuple[int, int, int]  # in patches

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def to_rgb(image: Any) -> Any:
    """RGB; transparency composited onto white (as HF and vLLM do), not dropped."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def preprocess_image(image: Any, config: ImageProcessorConfig) -> ProcessedImage:
    """One PIL image -> its patches and grid."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL.Image.Image, got {type(image).__name__}")
    c = config
    image = to_rgb(image)
    height, width = smart_resize(
        image.height, image.width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels
    )
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    array = np.asarray(resized).transpose(2, 0, 1)  # [C, H, W] uint8
    array = (array.astype(np.float64) * c.rescale_factor).astype(np.float32)
    mean = np.asarray(c.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(c.image_std, dtype=np.float32)[:, None, None]
    array = (array - mean) / std
    channels = array.shape[0]
    p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = array.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(
        patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p)
    )  # the still image repeated over the temporal patch
    flat = np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels * tp * p * p)
    return ProcessedImage(torch.from_numpy(flat), (1, grid_h, grid_w))
