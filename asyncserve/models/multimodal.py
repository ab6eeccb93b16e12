"""What the engine needs from a model that takes images (beside CausalLM's surface).

The runner (worker/mm_embeds.py) asks the model for the embeddings of the images a step
reaches (`embed_images`, batched, through the encoder cache), embeds the step's token ids
(`embed_input_ids`), writes the image rows over the placeholder positions and calls
`forward(..., inputs_embeds=...)`. A step that reaches no image calls the plain forward.

With tensor parallelism the language model is sharded like its text-only family; the vision
encoder and projector are replicated on every rank (each rank encodes the step's images from
the plan's items, which every worker receives), so the image rows need no broadcast.

Models with their own position ids (`uses_mrope`, Qwen2.5-VL's M-RoPE) get positions of
shape [3, T]: each request's rows from its MultiModalFeatures (prompt) or index + delta
(output tokens); text-only requests get their plain positions on all three rows. A step
past every image prompt (every decode step) gets [T] positions instead, index + delta: the
three rows are equal there and M-RoPE is plain RoPE, so the decode CUDA graphs apply.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.weights import Target, load_checkpoint
from asyncserve.multimodal.inputs import MultiModalItem


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the GPU. A pageable copy
    blocks until the stream's queued work (the step before, under async scheduling) is
    done, and this step's launches would only start then; a pinned one (from torch's
    caching host allocator, which keeps the block until the copy has read it) does not."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class MultiModalCausalLM(CausalLM):
    """A vision encoder in front of a text CausalLM (`language_model`), which computes the
    logits; checkpoint tensors go where `route` says."""

    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = False
    language_model: Any

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # type: ignore[no-any-return]

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.local_logits(hidden)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self.route)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings (before any image rows)."""
        raise NotImplementedError

    def embed_images(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """One [item.length, hidden] tensor per item (model dtype, on the model's device)."""
        raise NotImplementedError

    def encoder_input_shape(self) -> tuple[int, ...] | None:
        """The one shape of an image's `pixel_values` when every image is resized to it (its
        encoder can then replay CUDA graphs: worker/encoder_graphs.py); None otherwise."""
        return None

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, *encoder_input_shape()] pixels on the device -> [B, rows, hidden] embeddings
        (models with a fixed encoder input shape)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def route(self, hf_name: str) -> Target | None:
        """Where a checkpoint tensor goes (with its slice on this rank); None to skip it."""
        raise NotImplementedError

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        target = self.route(hf_name)
        return target.source if target is not None else None

    def checkpoint_skips(self, hf_name: str) -> bool:
        return self.route(hf_name) is None


def is_multimodal(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "supports_multimodal", False))


def uses_mrope(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "uses_mrope", False))
