"""CLIP / SigLIP image preprocessing with PIL and numpy: what transformers' CLIPImageProcessor
(and SiglipImageProcessor) compute, read from the checkpoint's preprocessor_config.json.

Steps, in HF's order: convert to RGB; resize (shortest edge to `size["shortest_edge"]`,
keeping the aspect ratio, or to `size["height"] x size["width"]`) with PIL's resampling on
8-bit pixels; center crop to `crop_size` (zero-padded when the image is smaller); rescale
(x * rescale_factor in float64, then float32); normalize per channel; channels first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Resized images above this many pixels are never made whole: a 16M x 1 image resized to a
# shortest edge of 336 would take 16 GB. A crop that follows is resampled straight from its
# source box (same filter, same sample centres); without a crop such an image is refused.
MAX_RESIZED_PIXELS = 1 << 24


@dataclass(frozen=True)
class ImageProcessor:
    size: dict[str, int]
    crop_size: dict[str, int] | None
    resample: int = 3  # PIL bicubic
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any], default_size: int) -> ImageProcessor:
        size = d.get("size", {"shortest_edge": default_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = d.get("crop_size") if d.get("do_center_crop", "crop_size" in d) else None
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            size={str(k): int(v) for k, v in size.items() if v is not None},
            crop_size=dict(crop) if crop else None,
            resample=int(d.get("resample", 3)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(x) for x in d.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(float(x) for x in d.get("image_std", _CLIP_STD)),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
        )

    def settings(self) -> tuple[Any, ...]:
        """What the output depends on besides the pixels (part of an image's hash)."""
        return (sorted(self.size.items()), self.crop_size and sorted(self.crop_size.items()),
                self.resample, self.rescale_factor, self.image_mean, self.image_std)  # fmt: skip

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """One image -> pixel values [3, H, W] float32."""
        if image.width < 1 or image.height < 1:
            raise ValueError(f"image has no pixels: {image.width}x{image.height}")
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            image = self._resize(image)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.crop_size is not None:
            pixels = _center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        out = pixels.astype(np.float64)
        if self.do_rescale:
            out = out * self.rescale_factor
        out = out.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            out = (out - mean) / std
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))

    def _resize(self, image: Image.Image) -> Image.Image:
        width, height = self._resized_size(image.width, image.height)
        if width * height <= MAX_RESIZED_PIXELS:
            return image.resize((width, height), self.resample)
        if self.crop_size is None:
            raise ValueError(
                f"image of {image.width}x{image.height} pixels would be resized to "
                f"{width}x{height}: over {MAX_RESIZED_PIXELS} pixels (aspect ratio too large)"
            )
        # Only the part of the resized image the center crop keeps.
        crop_w, crop_h = self.crop_size["width"], self.crop_size["height"]
        left = (width - crop_w) // 2 if width >= crop_w else 0
        top = (height - crop_h) // 2 if height >= crop_h else 0
        out_w, out_h = min(width, crop_w), min(height, crop_h)
        scale_x, scale_y = image.width / width, image.height / height
        box = (left * scale_x, top * scale_y, (left + out_w) * scale_x, (top + out_h) * scale_y)
        return image.resize((out_w, out_h), self.resample, box=box)

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after resizing, as HF computes it."""
        if "shortest_edge" in self.size:
            short = self.size["shortest_edge"]
            if width <= height:
                return short, int(short * height / width)
            return int(short * width / height), short
        return self.size["width"], self.size["height"]


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """HF's center crop of an [H, W, C] array: zero padding first when it is smaller."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        top_pad, left_pad = max(height - h, 0) // 2, max(width - w, 0) // 2
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        padded[top_pad : top_pad + h, left_pad : left_pad + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]
