"""Multimodal items as they travel from the front end to the worker: plain data and CPU tensors.

A processor (multimodal/processor.py) turns a prompt's token ids and its images into the
expanded token ids (each image's placeholder token repeated once per embedding row) and one
MultiModalItem per image. The items ride on the Request (core) and, once, in the new
request's NewRequestData of the StepPlan; the worker encodes them (encoder cache keyed by
`hash`) and writes the embeddings over the placeholder rows of the input embeddings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class MultiModalItem:
    """One image of a prompt.

    `data`: the model's encoder inputs (e.g. {"pixel_values": [3, H, W]}; Qwen2.5-VL adds its
    grid), CPU tensors. The image's embeddings fill prompt positions [offset, offset + length):
    every position there holds the placeholder token and takes one embedding row, in order.
    """

    modality: str
    data: dict[str, torch.Tensor]
    offset: int
    length: int
    # Content hash (hex) of the image and its processing: the encoder cache key, and part of
    # the prefix-cache hash of every KV block the placeholder run touches.
    hash: str

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def hash_key(self) -> int:
        """The hash as an int, for the KV block hashes."""
        return int(self.hash[:16], 16)


@dataclass
class MultiModalFeatures:
    """A request's items (in prompt order, non-overlapping) and, for models with their own
    position ids (M-RoPE), the prompt's positions: [3, num_prompt_tokens] int64; each token
    after the prompt sits at its index + `mrope_position_delta` on all three rows."""

    items: list[MultiModalItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0

    def block_extra_keys(self, start: int, end: int) -> tuple[int, ...]:
        """Hashes of the items whose placeholder run overlaps token positions [start, end)."""
        return tuple(i.hash_key for i in self.items if i.offset < end and i.end > start)


@dataclass
class MultiModalInputs:
    """A processor's output: the expanded prompt and the features that go with it."""

    prompt_token_ids: list[int]
    features: MultiModalFeatures


def image_hash(image: Any, *extra: object) -> str:
    """sha256 of a PIL image's mode, size and pixels, plus anything the processing depends on
    (`extra`, e.g. the processor's settings): equal images hash equal however they arrived."""
    h = hashlib.sha256()
    # A palette image's pixels are indices: its colours (and a transparency key, which
    # changes its RGB form) must be hashed too, or images of other colours hash equal.
    palette = image.getpalette(None) if image.mode in ("P", "PA") else None
    keyed = image.info.get("transparency")
    h.update(f"{image.mode}|{image.size}|{extra!r}|{palette!r}|{keyed!r}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()
