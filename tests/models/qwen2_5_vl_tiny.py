"""A tiny random Qwen2.5-VL built with transformers (fp32), shared by the Qwen2.5-VL tests.

Vision: 4 blocks (1 and 3 attend over the whole image, 0 and 2 within 56-pixel windows, i.e.
2x2 merged patches), hidden 32, patch 14, merge 2. Text: 2 layers, hidden 64, head_dim 16,
mrope_section [2, 3, 3] (sums to head_dim / 2). Special token ids sit inside the small vocab.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
IMAGE_TOKEN_ID = 300
VIDEO_TOKEN_ID = 301
VISION_START_ID = 302
VISION_END_ID = 303
EOS_ID = 2

VISION: dict[str, Any] = dict(
    depth=4,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=56,
    fullatt_block_indexes=[1, 3],
)
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 100.0},
    bos_token_id=1,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)


def hf_tiny_model(
    seed: int = 0,
    vocab: int = VOCAB,
    image_token_id: int = IMAGE_TOKEN_ID,
    vision_start_id: int = VISION_START_ID,
    vision_end_id: int = VISION_END_ID,
    eos_id: int = EOS_ID,
) -> Any:
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": vocab, "eos_token_id": eos_id},
        vision_config=VISION,
        image_token_id=image_token_id,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=vision_start_id,
        vision_end_token_id=vision_end_id,
        eos_token_id=eos_id,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random init leaves norms at 1 and biases at 0: perturb them so every weight
            # matters.
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
            # Larger merger weights, so that different images give different tokens, and
            # sharper text attention, so that positions (M-RoPE) change the tokens.
            if ".merger.mlp." in name and name.endswith("weight"):
                p.mul_(8.0)
            if "language_model" in name and (".q_proj." in name or ".k_proj." in name):
                p.mul_(8.0)
    return model


# Qwen2.5-VL's chat template, reduced to text and image parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 16  # at most 16 image tokens


def build_tiny_qwen2_5_vl(root: Path, gguf_path: Path) -> Path:
    """A checkpoint directory as save_pretrained writes it: the model, the SmolLM2 tokenizer
    plus Qwen's vision tokens, a chat template and the image processor's config."""
    from tokenizers import AddedToken
    from transformers import Qwen2VLImageProcessorPil

    from asyncserve.models.gguf_loader import open_gguf
    from asyncserve.tokenizer import Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)
    backend = tokenizer.backend
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    backend.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    ids = {n: backend.token_to_id(n) for n in names}
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    assert tokenizer.eos_token_id is not None
    model = hf_tiny_model(
        vocab=max(ids.values()) + 1,
        image_token_id=ids["<|image_pad|>"],
        vision_start_id=ids["<|vision_start|>"],
        vision_end_id=ids["<|vision_end|>"],
        eos_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(root)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(root)
    return root
