"""Image embeddings (tower + projector) equal to transformers' get_image_features for SigLIP
and CLIP towers, several feature layers and both select strategies; both checkpoint layouts;
the engine-side pieces (placeholder expansion, encoder cache, M-RoPE positions)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncserve.config import ModelConfig
from asyncserve.models.llava import normalize_name
from asyncserve.models.loader import load_model
from asyncserve.multimodal.inputs import MultiModalFeatures, MultiModalItem
from asyncserve.multimodal.processor import expand_placeholders
from asyncserve.worker.encoder_cache import EncoderCache
from asyncserve.worker.mm_embeds import mrope_positions


def _tiny(root: Path, tower: str, layer: Any, strategy: str, new_layout: bool) -> Any:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )

    shape = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=3, num_attention_heads=4)  # fmt: skip
    vision = SiglipVisionConfig(**shape) if tower == "siglip" else CLIPVisionConfig(**shape)
    text = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=299,
                         vision_feature_layer=layer, vision_feature_select_strategy=strategy)  # fmt: skip
    torch.manual_seed(1)
    hf = LlavaForConditionalGeneration(config).eval()
    hf.save_pretrained(root)
    if new_layout:  # transformers' current names, whatever this version saved
        tensors = load_file(str(root / "model.safetensors"))
        renamed = {}
        for name, tensor in tensors.items():
            ours = normalize_name(name)
            if ours.startswith("language_model.lm_head."):
                renamed[ours.removeprefix("language_model.")] = tensor
            elif ours.startswith("language_model.model."):
                renamed["model.language_model." + ours.removeprefix("language_model.model.")] = (
                    tensor
                )
            elif ours.startswith("vision_tower."):
                renamed["model.vision_tower.vision_model." + ours.removeprefix("vision_tower.")] = (
                    tensor
                )
            else:
                renamed["model." + ours] = tensor
        save_file(renamed, str(root / "model.safetensors"))
    return hf


@pytest.mark.parametrize(
    ("tower", "layer", "strategy", "new_layout"),
    [
        ("siglip", [-2, -1], "full", True),
        ("clip", 0, "full", False),
        ("clip", [1, -1], "default", True),
    ],
)
def test_image_features_equal_transformers(
    tmp_path: Path, tower: str, layer: Any, strategy: str, new_layout: bool
) -> None:
    pytest.importorskip("transformers")
    hf = _tiny(tmp_path, tower, layer, strategy, new_layout)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    model: Any = loaded.model
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    expected = hf.model.get_image_features(
        pixels,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        output_hidden_states=True,
    ).pooler_output
    tokens = 16 + (1 if tower == "clip" and strategy == "full" else 0)
    items = [
        MultiModalItem("image", {"pixel_values": p}, 0, tokens, str(i))
        for i, p in enumerate(pixels)
    ]
    with torch.no_grad():
        got = model.embed_images(items)
    assert [g.shape for g in got] == [(tokens, 64)] * 2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_expand_placeholders() -> None:
    ids, offsets = expand_placeholders([1, 9, 2, 9, 3], 9, [3, 2])
    assert ids == [1, 9, 9, 9, 2, 9, 9, 3] and offsets == [1, 5]
    # Already expanded (e.g. a prompt sent back as token ids): taken as it is.
    assert expand_placeholders(ids, 9, [3, 2]) == (ids, offsets)
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        expand_placeholders([9, 9], 9, [4])


def test_encoder_cache_evicts_least_recently_used() -> None:
    cache = EncoderCache(capacity_rows=10)
    cache.put("a", torch.zeros(4, 2))
    cache.put("b", torch.zeros(4, 2))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", torch.zeros(4, 2))  # evicts b
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("huge", torch.zeros(11, 2))  # larger than the cache: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2


def test_mrope_positions_per_request() -> None:
    # Request r1: a 4-token prompt with its own positions, then output tokens (delta -2);
    # request r2: plain positions on all three rows.
    rows = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 2], [0, 1, 1, 1]])
    feats = MultiModalFeatures(mrope_positions=rows, mrope_position_delta=-2)
    states = {
        "r1": SimpleNamespace(mm_features=feats, prompt_token_ids=[5] * 4),
        "r2": SimpleNamespace(mm_features=None, prompt_token_ids=[5] * 9),
    }
    inputs = SimpleNamespace(
        request_ids=["r1", "r2"], starts=[2, 7], counts=[4, 2],
        positions=torch.tensor([2, 3, 4, 5, 7, 8]),
    )  # fmt: skip
    out = mrope_positions(inputs, states)  # type: ignore[arg-type]
    expected = torch.tensor([[1, 2, 2, 3, 7, 8], [2, 2, 2, 3, 7, 8], [1, 1, 2, 3, 7, 8]])
    assert torch.equal(out, expected)
