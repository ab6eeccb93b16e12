"""FP8 checkpoints as published: compressed-tensors FP8 (channel and block strategies, saved
by llmcompressor: tests/fixtures/quantized/make_fixtures.py) and HF `quant_method: "fp8"`
(per tensor, and FP8-block with `weight_scale_inv`). asyncserve's logits are compared with
transformers running the dequantized weights in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncserve.config import ModelConfig
from asyncserve.kernels.quant_reference import (
    FP8_DTYPE,
    dequant_fp8_blocks,
    per_token_group_quant_fp8,
)
from asyncserve.models.loader import load_model
from tests.models.conftest import full_forward

CPU = torch.device("cpu")
# HF projection -> (fused parameter, (part, parts)): every part is 128 rows here.
_SHARDS = {
    ".q_proj.": (".qkv_proj.", (0, 3)),
    ".k_proj.": (".qkv_proj.", (1, 3)),
    ".v_proj.": (".qkv_proj.", (2, 3)),
    ".gate_proj.": (".gate_up_proj.", (0, 2)),
    ".up_proj.": (".gate_up_proj.", (1, 2)),
}
FIXTURES = Path(__file__).parent.parent / "fixtures" / "quantized"
IDS = [1, 17, 200, 45, 3, 99, 128, 7, 250, 64, 12, 33]
# Activations are quantized to e4m3 per token (or per 128 columns) at run time, which the
# dequantized reference does not do: 3 mantissa bits, ~2^-5 relative error per element.
# On these random models (logits spanning ~4) the measured max |diff| is 3-5% of the span.
REL_TOL = 0.06


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def dequantized_state(path: Path, block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights: each fp8 weight times its scale (per channel, per tensor, or
    per block), the way the checkpoint format defines them."""
    tensors = read_tensors(path)
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.dtype != FP8_DTYPE:
            if t.is_floating_point() and "scale" not in name:
                out[name] = t.float()
            continue
        base = name[: -len(".weight")]
        scale = tensors.get(base + ".weight_scale", tensors.get(base + ".weight_scale_inv"))
        assert scale is not None, name
        if block is not None:
            out[name] = dequant_fp8_blocks(t, scale.float(), block)
        else:
            out[name] = t.float() * scale.float().reshape(-1, 1)
    return out


def reference_logits(state: dict[str, torch.Tensor], act_group: int | None = None) -> torch.Tensor:
    """transformers' Llama in fp32 on `state`; with act_group, each projection's input is
    also quantized to e4m3 and back per token and `act_group` columns (what asyncserve does
    at run time), which makes the comparison exact up to summation order."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig.from_pretrained(str(FIXTURES / "llama-bf16"))
    model = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    if act_group is not None:

        def fake_quant(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
            x = args[0].reshape(-1, args[0].shape[-1])
            q, s = per_token_group_quant_fp8(x, act_group)
            dq = q.float() * s.repeat_interleave(act_group, 1)[:, : x.shape[1]]
            return (dq.reshape(args[0].shape),)

        for name, module in model.named_modules():
            if name.endswith("proj"):
                module.register_forward_pre_hook(fake_quant)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


def our_logits(path: Path, **kwargs: Any) -> tuple[torch.Tensor, torch.nn.Module]:
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", **kwargs), CPU)
    return full_forward(loaded.model, IDS), loaded.model


def assert_matches(
    ours: torch.Tensor,
    state: dict[str, torch.Tensor],
    original: dict[str, torch.Tensor] | None = None,
) -> None:
    """Within float summation order of the dequantized model with its activations quantized
    as asyncserve quantizes them (per token: every K here is 128, one group), and within
    REL_TOL of the dequantized model (of `original`, when given: the unquantized weights)."""
    torch.testing.assert_close(ours, reference_logits(state, 128), rtol=1e-4, atol=1e-4)
    ref = reference_logits(original if original is not None else state)
    span = float(ref.max() - ref.min())
    diff = float((ours - ref).abs().max())
    assert diff <= REL_TOL * span, f"max |diff| {diff:.4f} over a logit range of {span:.3f}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def write_hf_fp8(
    root: Path, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any]
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = json.loads((FIXTURES / "llama-bf16" / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(
    ("fixture", "block", "scale_name"),
    [("llama-fp8-dynamic", None, "weight_scale"), ("llama-fp8-block", (128, 128), "weight_scale")],
)
def test_compressed_tensors_fp8_matches_dequantized(
    fixture: str, block: tuple[int, int] | None, scale_name: str
) -> None:
    path = FIXTURES / fixture
    ours, model = our_logits(path)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert f"model.layers.1.mlp.down_proj.{scale_name}" in params
    assert_matches(ours, dequantized_state(path, block))


def test_hf_fp8_block_checkpoint(tmp_path: Path) -> None:
    """The FP8-block layout (DeepSeek-V3 and the HF FP8 quantizer): weight_scale_inv per
    128 x 128 block, `weight_block_size` in the config."""
    tensors = read_tensors(FIXTURES / "llama-fp8-block")
    renamed = {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in tensors.items()}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = write_hf_fp8(tmp_path / "block", renamed, qc)
    ours, model = our_logits(path)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in dict(model.named_parameters())
    assert_matches(ours, dequantized_state(path, (128, 128)))


def test_hf_fp8_per_tensor_checkpoint_keeps_each_shard_scale(tmp_path: Path) -> None:
    """Per-tensor scales (and static input scales, which are not read): q, k and v keep
    their own scale inside the fused projection."""
    tensors = read_tensors(FIXTURES / "llama-bf16")
    out: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if "layers" in name and name.endswith("proj.weight"):
            w = t.float() * (1 + 0.05 * i)  # a different range per tensor
            scale = w.abs().max() / 448
            out[name] = (w / scale).to(FP8_DTYPE)
            out[name + "_scale"] = scale.reshape(())
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.1)
        else:
            out[name] = t
    qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    path = write_hf_fp8(tmp_path / "tensor", out, qc)
    ours, _ = our_logits(path)
    assert_matches(ours, dequantized_state(path))


def test_online_fp8_on_the_bf16_checkpoint_matches_its_own_dequantization() -> None:
    ours, model = our_logits(FIXTURES / "llama-bf16", quantization="fp8")
    original = {k: v.float() for k, v in read_tensors(FIXTURES / "llama-bf16").items()}
    quantized = dict(original)
    params = dict(model.named_parameters())
    for name in original:
        for part, (fused, (index, parts)) in _SHARDS.items():
            if part in name:
                fused_name = name.replace(part, fused)
                w = params[fused_name].float() * params[fused_name + "_scale"]
                quantized[name] = w.chunk(parts)[index]
        if ".o_proj." in name or ".down_proj." in name:
            quantized[name] = params[name].float() * params[name + "_scale"]
    # Each weight is within e4m3 rounding of the original.
    for name, w in quantized.items():
        torch.testing.assert_close(w, original[name], rtol=2**-4, atol=1e-4)
    assert_matches(ours, quantized, original)


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "awq_marlin"}, "quant_method 'awq_marlin' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [100, 128]}, "weight_block_size"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            "compressed-tensors scheme not supported: int8 channel weights with dynamic",
        ),
    ],
)
def test_unsupported_schemes_are_one_line_errors(
    tmp_path: Path, qc: dict[str, Any], message: str
) -> None:
    shutil.copytree(FIXTURES / "llama-bf16", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=message) as info:
        load_model(ModelConfig(model=str(tmp_path / "m")), CPU)
    assert "\n" not in str(info.value)


def test_quantization_flag_errors() -> None:
    bf16 = str(FIXTURES / "llama-bf16")
    with pytest.raises(ValueError, match="'compressed-tensors' needs a checkpoint quantized"):
        load_model(ModelConfig(model=bf16, quantization="compressed-tensors"), CPU)
    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        load_model(ModelConfig(model=bf16, quantization="int3"), CPU)
    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method"):
        load_model(ModelConfig(model=str(FIXTURES / "llama-fp8-dynamic"), quantization="fp8"), CPU)


def test_quantization_flag_reaches_the_model_config() -> None:
    from asyncserve.cli import build_parser, engine_config_from_args
    from asyncserve.config import Environment

    env = Environment(api_key=None, default_model=None, log_level="INFO")
    for argv in (["serve", "--quantization", "fp8"], ["serve", "-q", "fp8"]):
        args = build_parser().parse_args(argv)
        assert engine_config_from_args(args, env).model.quantization == "fp8"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args, env).cache.cache_dtype == "fp8"
    args = build_parser().parse_args(["bench", "latency", "--quantization", "fp8"])
    assert args.quantization == "fp8"


def test_block_scales_of_a_fused_part_must_fill_whole_blocks() -> None:
    """A fused layer's part that starts inside a 128-row scale block cannot keep its own
    scales: a clear error instead of mixing two parts' scales."""
    from asyncserve.models.layers import Linear
    from asyncserve.models.weights import Target, load_checkpoint
    from asyncserve.quantization.fp8 import Fp8BlockLinearMethod

    layer = Linear(128, 256)
    del layer.weight
    Fp8BlockLinearMethod((128, 128), "weight_scale_inv").create_weights(
        layer, 128, 256, torch.float32
    )
    model = torch.nn.Sequential(layer)
    tensors = [("0.weight_scale_inv", torch.ones(1, 1))]
    with pytest.raises(ValueError, match="do not line up with its 128-row quantization blocks"):
        load_checkpoint(model, tensors, lambda name: Target(name, rows=(64, 64)))
