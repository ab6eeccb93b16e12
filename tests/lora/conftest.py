"""A tiny random Llama and random PEFT LoRA adapters made with `peft`, shared per session."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 320
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Adapter:
    path: Path
    model: Any  # the PEFT model: HF base + this adapter, the reference


def randomize(model: Any, only_lora: bool, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only_lora and "lora_" not in name:
                continue
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(noise + (1.0 if p.ndim == 1 and not only_lora else 0.0))


def make_adapter(base: Any, path: Path, seed: int, **lora_kwargs: Any) -> Adapter:
    """A PEFT LoRA adapter with random A and B on a copy of `base`, saved to `path`."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, **lora_kwargs)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    randomize(model, only_lora=True, scale=0.3, seed=seed)
    model.save_pretrained(str(path))
    model.eval()
    return Adapter(path, model)


def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@dataclass
class TinyLoRA:
    base_path: Path
    base: Any
    adapters: list[Adapter]


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory: pytest.TempPathFactory) -> TinyLoRA:
    """A tiny random Llama and three adapters of different ranks and targets."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().eval()
    randomize(base, only_lora=False, scale=0.1, seed=0)
    root = tmp_path_factory.mktemp("lora")
    base.save_pretrained(root / "base", safe_serialization=True)
    adapters = [
        make_adapter(base, root / "a", 1, r=8, lora_alpha=16, target_modules=ALL_MODULES),
        make_adapter(
            base,
            root / "b",
            2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
        ),  # fmt: skip
        make_adapter(
            base,
            root / "c",
            3,
            r=16,
            lora_alpha=32,
            target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        ),  # fmt: skip
    ]
    return TinyLoRA(root / "base", base, adapters)


def edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of an adapter folder with adapter_config.json fields changed."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst
