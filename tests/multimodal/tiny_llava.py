"""A tiny random LlavaForConditionalGeneration checkpoint (CLIP tower, Llama LM) saved with
transformers' save_pretrained, with the SmolLM2 tokenizer plus an `<image>` token, a CLIP
preprocessor config and a LLaVA-style chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_SIZE = 32
PATCH_SIZE = 8
# LLaVA-1.5's template: a message's images first, then its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tiny_llava(
    root: Path, gguf_path: Path, strategy: str = "default", vocab_multiple: int = 1
) -> Path:
    """`vocab_multiple`: special padding tokens after `<image>` until the vocabulary size is
    a multiple of it (tensor parallelism splits the vocabulary evenly)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from asyncserve.models.gguf_loader import open_gguf
    from asyncserve.tokenizer import Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)
    backend = tokenizer.backend
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    image_token_id = backend.token_to_id("<image>")
    pads = -(image_token_id + 1) % vocab_multiple
    pad_tokens = [AddedToken(f"<pad_{i}>", special=True, normalized=False) for i in range(pads)]
    backend.add_special_tokens(pad_tokens)
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
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=image_token_id + 1 + pads,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    # Larger weights than the default init, so different images give different tokens.
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(8.0)
    model.save_pretrained(root)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(root)
    (root / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))
    return root
