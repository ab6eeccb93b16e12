"""A tiny random Qwen2.5-VL built with transformers (fp32), shared by the Qwen2.5-VL tests.

Vision: 4 blocks (1 and 3 attend over the whole image, 0 and 2 within 56-pixel windows, i.e.
2x2 merged patches), hidden 32, patch 14, merge 2. Text: 2 layers, hidden 64, head_dim 16,
mrope_section [2, 3, 3] (sums to head_dim / 2). Special token ids sit inside the small vocab.
"""

from __future__ import annotations

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
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    bos_token_id=1,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)


def hf_tiny_model(seed: int = 0) -> Any:
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        eos_token_id=EOS_ID,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so every weight matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model
