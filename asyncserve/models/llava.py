"""LLaVA: a CLIP / SigLIP vision tower, a two-layer MLP projector and a Llama / Mistral LM.

An image's tower hidden states (`vision_feature_layer`: one layer or several, concatenated)
lose CLIP's class token under the "default" `vision_feature_select_strategy` ("full" keeps
it); the projector maps each remaining token to one embedding row of the language model, so
an image takes `num_image_tokens` placeholder positions in the prompt.

Checkpoint names: transformers' current layout (`model.vision_tower.`, `model.
multi_modal_projector.`, `model.language_model.`, `lm_head.`) and the older one
(`vision_tower.vision_model.`, `multi_modal_projector.`, `language_model.model.`,
`language_model.lm_head.`) both load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.layers import Linear
from asyncserve.models.multimodal import MultiModalCausalLM, host_to_device
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.pipeline import PipelineStage
from asyncserve.models.registry import resolve_model_class
from asyncserve.models.vision_tower import VisionArch, VisionTransformer, activation
from asyncserve.models.weights import Target
from asyncserve.multimodal.inputs import MultiModalItem

_TOP = ("vision_tower.", "multi_modal_projector.", "language_model.", "lm_head.")


@dataclasses.dataclass(frozen=True)
class LlavaArch:
    """The vision side of a LLaVA config."""

    vision: VisionArch
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default" (drop CLIP's class token) or "full"
    image_token_id: int
    projector_act: str
    projector_bias: bool

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlavaArch:
        vision = VisionArch.from_hf_dict(d.get("vision_config") or {})
        layer = d.get("vision_feature_layer", -2)
        layers = tuple(int(x) for x in layer) if isinstance(layer, list) else (int(layer),)
        strategy = str(d.get("vision_feature_select_strategy", "default"))
        if strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}"
            )
        token = d.get("image_token_index", d.get("image_token_id", 32000))
        return cls(
            vision=vision,
            feature_layers=layers,
            select_strategy=strategy,
            image_token_id=int(token),
            projector_act=str(d.get("projector_hidden_act", "gelu")),
            projector_bias=bool(d.get("multimodal_projector_bias", True)),
        )

    @property
    def num_image_tokens(self) -> int:
        return self.vision.num_positions - (1 if self.select_strategy == "default" else 0)


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultiModalCausalLM):
    def __init__(
        self,
        config: ArchConfig,
        ops: KernelOps,
        tp: TensorParallel = SINGLE,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        if pp is not None:
            raise ValueError(f"{config.architecture}: pipeline parallelism is not supported yet")
        if config.multimodal_config is None or config.text_architecture is None:
            raise ValueError("LlavaForConditionalGeneration needs its full (nested) config")
        self.config = config
        self.tp = tp
        self.llava = LlavaArch.from_hf_dict(config.multimodal_config)
        text = dataclasses.replace(
            config, architecture=config.text_architecture, multimodal_config=None
        )
        text_cls = resolve_model_class(config.text_architecture)
        # The language model shards as its family does; the tower and projector replicate.
        if tp.size > 1:
            self.language_model = text_cls(text, ops, tp=tp)  # type: ignore[call-arg]
        else:
            self.language_model = text_cls(text, ops)
        self.vision_tower = VisionTransformer(self.llava.vision)
        in_features = self.llava.vision.hidden_size * len(self.llava.feature_layers)
        self.multi_modal_projector = LlavaProjector(
            in_features, config.hidden_size, self.llava.projector_act, self.llava.projector_bias
        )

    @property
    def _text_model(self) -> Any:
        """The language model's decoder (embeddings, layers, final norm)."""
        return self.language_model.model

    # ---- multimodal surface ------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The placeholder id may lie past the vocabulary: its rows are overwritten anyway.
        safe = torch.where(input_ids < self.config.vocab_size, input_ids, 0)
        return self._text_model.embed_tokens(safe)  # type: ignore[no-any-return]

    def embed_images(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        pixels = torch.stack([item.data["pixel_values"] for item in items])
        device = self.multi_modal_projector.linear_1.weight.device
        return list(self.encode_pixels(host_to_device(pixels, device)).unbind(0))

    def encoder_input_shape(self) -> tuple[int, ...] | None:
        vision = self.llava.vision
        return (vision.num_channels, vision.image_size, vision.image_size)

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixels, list(self.llava.feature_layers))
        features = torch.cat(states, dim=-1)
        if self.llava.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)  # type: ignore[no-any-return]

    # ---- CausalLM surface --------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        self.language_model.check_caches(kv_caches)
        return self._text_model(  # type: ignore[no-any-return]
            input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds
        )

    def route(self, hf_name: str) -> Target | None:
        name = normalize_name(hf_name)
        if name.startswith("language_model."):
            route = getattr(self.language_model, "route", None)
            inner = name.removeprefix("language_model.")
            target = route(inner) if route is not None else Target(inner)
            if target is None:
                return None
            return dataclasses.replace(target, name="language_model." + target.name)
        if name.startswith("vision_tower.head."):
            return None  # SigLIP's pooling head: LLaVA reads the hidden states
        return Target(name)


def normalize_name(hf_name: str) -> str:
    """Any LLaVA checkpoint layout -> this module's parameter names."""
    name = hf_name
    if name.startswith("model.") and name[len("model.") :].startswith(_TOP):
        name = name[len("model.") :]
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("language_model.") and not name.startswith(
        ("language_model.model.", "language_model.lm_head.")
    ):
        return "language_model.model." + name[len("language_model.") :]
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model.") :]
    return name
