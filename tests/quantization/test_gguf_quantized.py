"""quantization="gguf": a tiny random Llama written as GGUF with quantized linear weights,
loaded with them kept quantized, gives the logits of the dequantized load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from asyncserve.config import ModelConfig
from asyncserve.llm import LLM
from asyncserve.models.loader import load_model
from asyncserve.outputs import RequestOutput
from asyncserve.quantization import resolve_quant_config
from asyncserve.quantization.gguf import GGUFLinearMethod
from asyncserve.sampling_params import SamplingParams
from tests.models.conftest import full_forward
from tests.models.tiny_gguf import TOKENS, write_tiny_gguf
from tests.quantization.conftest import greedy_agreement

# Both loads compute in fp32 from the same dequantized numbers; only the order of the
# sums may differ.
LOGITS_ATOL = 1e-4


def gguf_linear(qtype: T) -> Callable[[str], T | None]:
    """Every attention and MLP projection (and the embedding) in `qtype`; norms in F32."""
    return lambda name: qtype if name.endswith(".weight") and "norm" not in name else None


def write_gguf(path: Path, tensor_type: Callable[[str], T | None], width: int = 64) -> Path:
    """A random 2-layer Llama, hidden size `width` (Q4_K's super-blocks need 256)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=len(TOKENS),
        hidden_size=width,
        intermediate_size=width * 3 // 2 if width < 256 else width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=width // 4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(
        path,
        "llama",
        state,
        heads=4,
        kv_heads=2,
        head_dim=width // 4,
        rope_theta=10000.0,
        eps=1e-5,
        tensor_type=tensor_type,
    )
    return path


@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "q8_0.gguf", gguf_linear(T.Q8_0))


def _logits(path: Path, quantization: str | None) -> tuple[torch.Tensor, torch.nn.Module]:
    loaded = load_model(
        ModelConfig(model=str(path), dtype="float32", quantization=quantization),
        torch.device("cpu"),
    )
    ids = [0, *range(5, 25)]
    return full_forward(loaded.model, ids), loaded.model


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K])
def test_kept_quantized_logits_match_dequantized_load(
    qtype: T, q8_0_file: Path, tmp_path: Path
) -> None:
    width = 256 if qtype == T.Q4_K else 64
    path = (
        q8_0_file if qtype == T.Q8_0 else write_gguf(tmp_path / "q.gguf", gguf_linear(qtype), width)
    )
    expected, _ = _logits(path, None)
    ours, model = _logits(path, "gguf")
    torch.testing.assert_close(ours, expected, atol=LOGITS_ATOL, rtol=0)
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer
    for layer in layers:
        assert isinstance(layer.quant_method, GGUFLinearMethod)
        assert layer.quant_method.qtype == qtype
        assert not hasattr(layer, "weight")  # only the packed form is kept
        expected_dtype = torch.int8 if qtype == T.Q8_0 else torch.int32
        assert layer.gguf_qweight.dtype == expected_dtype


def test_mixed_types_keep_only_uniform_layers(tmp_path: Path) -> None:
    """k_proj in F32: the fused qkv projection is dequantized, the rest stay Q8_0."""

    def types(name: str) -> T | None:
        return None if "attn_k." in name else gguf_linear(T.Q8_0)(name)

    path = write_gguf(tmp_path / "mixed.gguf", types)
    expected, _ = _logits(path, None)
    ours, model = _logits(path, "gguf")
    torch.testing.assert_close(ours, expected, atol=LOGITS_ATOL, rtol=0)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.quant_method is None and attn.qkv_proj.weight.dtype == torch.float32
    assert isinstance(attn.o_proj.quant_method, GGUFLinearMethod)


def test_llm_generates_as_the_dequantized_model(q8_0_file: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [0, 7, 9, 11]}]
    outs = []
    for quantization in (None, "gguf"):
        llm = LLM(str(q8_0_file), device="cpu", quantization=quantization, dtype="float32",
                  max_model_len=64, kv_cache_memory=4 << 20)  # fmt: skip
        outs.append(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.close()
    assert len(outs[0]) == 8 and outs[0] == outs[1]


def test_smollm2_q4_1_kept_quantized_agrees_with_dequantized(
    gguf_path: Path, greedy_reference: list[RequestOutput]
) -> None:
    """The default SmolLM2 file's linear layers are all Q4_1: kept quantized, the model
    computes (on CPU, in fp32) from the same weights as the dequantized load, so every one
    of 8 x 32 greedy positions agrees."""
    llm = LLM(str(gguf_path), device="cpu", max_model_len=256, kv_cache_memory=16 << 20,
              quantization="gguf")  # fmt: skip
    try:
        agree, total = greedy_agreement(llm, greedy_reference)
    finally:
        llm.close()
    assert total == 8 * 32 and agree == total, f"{agree}/{total} positions agree"


def test_gguf_quantization_needs_a_gguf_model() -> None:
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quant_config("gguf", {}, torch.device("cpu"))
