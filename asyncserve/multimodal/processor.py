"""MultiModalProcessor: (prompt token ids, images) -> expanded token ids + per-image items.

A multimodal model's processor lives beside its model and is found by architecture name
(_PROCESSORS). It runs in the front end (engine process): offline in LLM.generate, in the
server on a worker thread (image decoding and resizing are CPU work). Models without an entry
are text-only: a request with images gets a clear error.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from asyncserve.multimodal.inputs import MultiModalInputs

if TYPE_CHECKING:
    from PIL.Image import Image

    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.tokenizer import Tokenizer

T = TypeVar("T")

# architecture -> (module under asyncserve.multimodal, processor class)
_PROCESSORS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("llava_processor", "LlavaProcessor"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_processor", "Qwen2_5_VLProcessor"),
}


class MultiModalProcessor(ABC):
    """Turns a prompt with image placeholders into what the engine schedules and encodes."""

    # The placeholder as the prompt text spells it (one per image, before expansion) and
    # its token id; each is expanded to one id per embedding row of its image.
    image_token: str
    image_token_id: int

    @classmethod
    @abstractmethod
    def from_pretrained(
        cls, root: Path, arch: ArchConfig, tokenizer: Tokenizer
    ) -> MultiModalProcessor:
        """From a checkpoint directory (preprocessor_config.json, processor_config.json)."""

    @abstractmethod
    def process(self, prompt_token_ids: list[int], images: list[Image]) -> MultiModalInputs:
        """Expand the placeholders and preprocess the images; ValueError on a mismatch
        (placeholders vs images) or an image the model cannot take."""


class ImageError(ValueError):
    """An image the model cannot take; `index` says which of the prompt's images."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"image {index}: {message}")
        self.index = index


def preprocess_each(images: list[Image], preprocess: Callable[[Image], T]) -> list[T]:
    """`preprocess` over the images, a ValueError naming the image that failed."""
    out = []
    for i, image in enumerate(images):
        try:
            out.append(preprocess(image))
        # OSError: an image opened lazily (offline) whose data is truncated or unreadable
        # fails when its pixels are first read, here.
        except (ValueError, OSError) as exc:
            raise ImageError(i, str(exc)) from exc
    return out


def supports_images(arch: str) -> bool:
    return arch in _PROCESSORS


def build_processor(
    arch: ArchConfig, model_path: str, tokenizer: Tokenizer
) -> MultiModalProcessor | None:
    """The model's processor, or None for a text-only model."""
    entry = _PROCESSORS.get(arch.architecture)
    if entry is None:
        return None
    module = importlib.import_module(f"asyncserve.multimodal.{entry[0]}")
    cls: type[MultiModalProcessor] = getattr(module, entry[1])
    root = Path(model_path)
    return cls.from_pretrained(root if root.is_dir() else root.parent, arch, tokenizer)


def expand_placeholders(
    prompt_token_ids: list[int], token_id: int, lengths: list[int], token: str = "image"
) -> tuple[list[int], list[int]]:
    """Repeat the i-th occurrence of `token_id` lengths[i] times.

    Returns the expanded ids and each image's offset in them. A prompt whose placeholders
    are already expanded (exactly sum(lengths) of them, in runs of the right lengths) is
    taken as it is, so a prompt can be sent again as token ids.
    """
    positions = [i for i, t in enumerate(prompt_token_ids) if t == token_id]
    if len(positions) == sum(lengths) and len(positions) != len(lengths):
        offsets, at = [], 0
        for n in lengths:
            run = positions[at : at + n]
            if run != list(range(run[0], run[0] + n)):
                break
            offsets.append(run[0])
            at += n
        else:
            return list(prompt_token_ids), offsets
    if len(positions) != len(lengths):
        raise ValueError(
            f"the prompt has {len(positions)} {token} placeholder(s) for {len(lengths)} "
            f"image(s): put one placeholder per image in the prompt"
        )
    out: list[int] = []
    offsets = []
    prev = 0
    for pos, n in zip(positions, lengths, strict=True):
        out.extend(prompt_token_ids[prev:pos])
        offsets.append(len(out))
        out.extend([token_id] * n)
        prev = pos + 1
    out.extend(prompt_token_ids[prev:])
    return out, offsets


def as_image_list(data: Any) -> list[Image]:
    """multi_modal_data["image"]: one PIL image or a list of them."""
    from PIL.Image import Image

    images = data if isinstance(data, list | tuple) else [data]
    for i, image in enumerate(images):
        if not isinstance(image, Image):
            raise ValueError(
                f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, "
                f"got {type(image).__name__}"
            )
    return list(images)
