"""Qwen2.5-VL: its vision transformer (qwen2_5_vl_vision.py) + the Qwen2 language model with
M-RoPE (llama.py with `mrope_section`, positions from mrope.py).

Each image's placeholder run (`<|image_pad|>` repeated t*h*w / merge^2 times between
`<|vision_start|>` and `<|vision_end|>`) takes the merger's output rows in order. Positions
come from the runner as [3, T] rows (the prompt's from its MultiModalFeatures, index + delta
after it), so the model itself has nothing position-specific beyond its rotary.

Checkpoint names: transformers' current layout (`model.visual.`, `model.language_model.`,
`lm_head.`) and the older one (`visual.`, `model.`, `lm_head.`) both load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.multimodal import MultiModalCausalLM, host_to_device
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.pipeline import PipelineStage
from asyncserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, VisionConfig
from asyncserve.models.weights import Target
from asyncserve.multimodal.inputs import MultiModalItem


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLArch:
    """The vision side of a Qwen2.5-VL config and its special token ids."""

    vision: VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen2_5_VLArch:
        vision = d.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("Qwen2_5_VLForConditionalGeneration: vision_config is missing")
        return cls(
            vision=VisionConfig.from_hf_dict(vision),
            image_token_id=int(d.get("image_token_id", 151655)),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
        )


class Qwen2_5_VLForConditionalGeneration(MultiModalCausalLM):
    uses_mrope = True

    def __init__(
        self,
        config: ArchConfig,
        ops: KernelOps,
        tp: TensorParallel = SINGLE,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        if pp is not None:
            raise ValueError(
                "Qwen2_5_VLForConditionalGeneration does not support pipeline parallelism yet"
            )
        if config.multimodal_config is None:
            raise ValueError("Qwen2_5_VLForConditionalGeneration needs its full config")
        if not config.mrope_section:
            raise ValueError("Qwen2_5_VLForConditionalGeneration needs rope mrope_section")
        self.config = config
        self.tp = tp
        self.vl = Qwen2_5_VLArch.from_hf_dict(config.multimodal_config)
        if self.vl.vision.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.vl.vision.out_hidden_size} differs from the "
                f"language model's hidden_size {config.hidden_size}"
            )
        text = dataclasses.replace(config, architecture="Qwen2ForCausalLM", multimodal_config=None)
        # The language model shards as Qwen2 does; the vision transformer replicates.
        self.language_model = LlamaForCausalLM(text, ops, tp=tp)
        self.visual = Qwen2_5_VisionTransformer(self.vl.vision, ops)

    # ---- multimodal surface ------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def embed_images(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """All items through the vision transformer in one call, split per item."""
        grids = [image_grid(item) for item in items]
        device = self.visual.patch_embed.proj.weight.device
        pixels = host_to_device(torch.cat([item.data["pixel_values"] for item in items]), device)
        embeds = self.visual(pixels, grids)
        dtype = self.language_model.model.norm.weight.dtype
        sizes = [self.visual.num_tokens(g) for g in grids]
        for item, size in zip(items, sizes, strict=True):
            if item.length != size:
                raise ValueError(f"image item has {item.length} placeholders for {size} rows")
        return list(embeds.to(dtype).split(sizes))

    # ---- CausalLM surface --------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.language_model.check_caches(kv_caches)
        return self.language_model.model(  # type: ignore[no-any-return]
            input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds
        )

    def route(self, hf_name: str) -> Target | None:
        if hf_name.startswith(("model.visual.", "visual.")):
            return Target("visual." + hf_name.split("visual.", 1)[1])
        if hf_name.startswith("model.language_model."):
            inner = "model." + hf_name[len("model.language_model.") :]
        else:
            inner = hf_name  # older layout: model.* and lm_head.* are the language model's
        target = self.language_model.route(inner)
        if target is None:
            return None
        return dataclasses.replace(target, name="language_model." + target.name)


def image_grid(item: MultiModalItem) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in item.data["image_grid_thw"].tolist())
    return t, h, w
