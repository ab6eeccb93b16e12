"""4-bit weight-only checkpoints: compressed-tensors W4A16 (saved by llmcompressor: round to
nearest and GPTQ; with activation order "group", which llmcompressor no longer writes,
written here), GPTQ as AutoRound exports it (asymmetric), GPTQ (sym / asym, act order) and
AWQ written here following the published packing code
(AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear). Each test unpacks the
checkpoint independently of asyncserve (nibble by nibble, as the format describes it),
checks the result against the original weights, and compares asyncserve's logits with
transformers running those dequantized weights in fp32: weight-only, so they agree to float
summation order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import ModelConfig
from asyncserve.models.loader import load_model
from tests.models.conftest import full_forward
from tests.quantization.test_fp8_checkpoints import (
    FIXTURES,
    IDS,
    read_tensors,
    reference_logits,
)

CPU = torch.device("cpu")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def nibbles(word: torch.Tensor, i: int) -> torch.Tensor:
    return (word >> (4 * i)) & 0xF


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight: [K, N] -> int32 [K / 8, N], row 8j + i in nibble i of row j."""
    packed = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for i in range(8):
        packed |= values[i::8].long() << (4 * i)
    return _int32(packed)


def pack_cols(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] -> int32 [R, C / 8], column 8j + order[i] in nibble i of word j."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        packed |= values[:, order[i] :: 8].long() << (4 * i)
    return _int32(packed)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize(w: torch.Tensor, groups_of: torch.Tensor, num_groups: int, sym: bool):  # type: ignore[no-untyped-def]
    """Min-max 4-bit quantization of w [N, K] by input group: (q [N, K], scale, zero [N, G])."""
    scale = torch.empty(w.shape[0], num_groups)
    zero = torch.empty(w.shape[0], num_groups)
    for g in range(num_groups):
        cols = w[:, groups_of == g]
        lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
        if sym:
            scale[:, g] = torch.maximum(lo.abs(), hi) * 2 / 15
            zero[:, g] = 8
        else:
            scale[:, g] = (hi - lo) / 15
            zero[:, g] = torch.round(-lo / scale[:, g])
    q = torch.clamp(torch.round(w / scale[:, groups_of]) + zero[:, groups_of], 0, 15)
    return q.to(torch.int32), scale, zero.to(torch.int32)


def act_order_g_idx(name: str, k: int, group: int) -> torch.Tensor:
    """GPTQ's desc_act: columns join groups in a permuted order (g_idx [k]); projections of
    the same input (q/k/v, gate/up) share the order (and the Hessian it comes from)."""
    shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
    gen = torch.Generator().manual_seed(sum(map(ord, shared.replace("up_", "gate_"))))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    return g_idx


def compressed_tensors_act_order(
    tensors: dict[str, torch.Tensor], group: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """An unquantized checkpoint's projections as compressed-tensors W4A16 with activation
    order "group" (as llmcompressor wrote it before 0.14, and vLLM reads it): weight_packed
    (nibble i of word j = column 8j + i, signed values + 8), weight_scale [N, groups],
    weight_g_idx [K], weight_shape. Returns (tensors, quantization_config, dequantized)."""
    out: dict[str, torch.Tensor] = {}
    dequantized = {}
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            out[name] = t
            continue
        w, base = t.float(), name[: -len(".weight")]
        g_idx = act_order_g_idx(name, w.shape[1], group)
        q, scale, zero = quantize(w, g_idx, w.shape[1] // group, sym=True)
        assert (zero == 8).all()
        out[base + ".weight_packed"] = pack_cols(q, list(range(8)))
        out[base + ".weight_scale"] = scale.to(torch.bfloat16)
        out[base + ".weight_g_idx"] = g_idx.to(torch.int32)
        out[base + ".weight_shape"] = torch.tensor(list(w.shape))
        s16 = scale.to(torch.bfloat16).float()
        dequantized[name] = (q - 8).float() * s16[:, g_idx]
    config = json.loads((FIXTURES / "llama-w4a16" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["config_groups"]["group_0"]["weights"].update(actorder="group", group_size=group)
    return out, qc, dequantized


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], qc: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = json.loads((FIXTURES / "llama-bf16" / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return root


def check(
    path: Path, dequantized: dict[str, torch.Tensor], group: int, rounded: bool = True
) -> None:
    """rounded: each weight rounded to its nearest level (else GPTQ moved it to compensate
    its neighbours' errors: the whole tensor still close, a misread layout is not)."""
    original = {k: v.float() for k, v in read_tensors(FIXTURES / "llama-bf16").items()}
    for name, w in dequantized.items():
        # Within half a quantization step of the original: the layout was read right.
        step = (original[name].abs().amax() * 2 / 15).item()
        if rounded:
            assert (w - original[name]).abs().max() <= step, name
        else:
            assert (w - original[name]).norm() <= 0.2 * original[name].norm(), name
    loaded = load_model(ModelConfig(model=str(path), dtype="float32"), CPU)
    params = dict(loaded.model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.w4_qweight"].shape == (384, 128 // 8)
    ours = full_forward(loaded.model, IDS)
    torch.testing.assert_close(
        ours, reference_logits({**original, **dequantized}), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("fixture", ["llama-w4a16", "llama-w4a16-gptq"])
def test_compressed_tensors_w4a16(fixture: str) -> None:
    """llmcompressor's W4A16: round to nearest (QuantizationModifier) and GPTQ (GPTQModifier,
    activation order "weight", calibrated; its weights move to compensate the error)."""
    path = FIXTURES / fixture
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]["weights"]["group_size"]
    dequantized = {}
    for name, packed in read_tensors(path).items():
        if name.endswith(".weight_packed"):
            scale = read_tensors(path)[name.replace("weight_packed", "weight_scale")].float()
            # Nibble i of word j is column 8j + i, stored offset by 8 (signed int4 + 8).
            q = torch.stack([nibbles(packed, i) for i in range(8)], dim=-1).flatten(1)
            w = (q.float() - 8) * scale.repeat_interleave(group, 1)
            dequantized[name.replace("weight_packed", "weight")] = w
    assert len(dequantized) == 14
    check(path, dequantized, group, rounded=fixture == "llama-w4a16")


def test_compressed_tensors_w4a16_group_act_order(tmp_path: Path) -> None:
    tensors, qc, dequantized = compressed_tensors_act_order(
        read_tensors(FIXTURES / "llama-bf16"), 64
    )
    check(write_checkpoint(tmp_path / "ct", tensors, qc), dequantized, 64)


def test_autoround_gptq() -> None:
    """AutoRound's export in AutoGPTQ's format (asymmetric, group 64), decoded as the format
    describes it: qweight [K / 8, N] with input 8j + i in nibble i of row j, qzeros
    [groups, N / 8] with output 8j + i in nibble i of word j, stored minus one."""
    path = FIXTURES / "llama-gptq"
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["sym"], qc["desc_act"]) == ("gptq", False, False)
    group = qc["group_size"]
    tensors = read_tensors(path)
    original = read_tensors(FIXTURES / "llama-bf16")
    dequantized = {}
    for name, qweight in tensors.items():
        if not name.endswith(".qweight"):
            continue
        base = name[: -len(".qweight")]
        q = torch.stack([nibbles(qweight, i) for i in range(8)], dim=1).flatten(0, 1)  # [K, N]
        zeros = torch.stack([nibbles(tensors[base + ".qzeros"], i) for i in range(8)], dim=-1)
        zeros = zeros.flatten(1) + 1  # [groups, N]
        scales = tensors[base + ".scales"].float()
        g_idx = tensors[base + ".g_idx"].long()
        assert torch.equal(g_idx, torch.arange(q.shape[0]) // group)
        w = ((q - zeros[g_idx]).float() * scales[g_idx]).t()
        # Round to nearest: every weight within half its group's step, give or take the
        # fp16 rounding of the stored scale (a zero point off by one is a step off).
        err = (w - original[base + ".weight"].float()).abs()
        assert (err <= scales[g_idx].t() * 0.6).all(), name
        dequantized[base + ".weight"] = w
    assert len(dequantized) == 14
    check(path, dequantized, group)


@pytest.mark.parametrize(("sym", "desc_act"), [(True, False), (False, True)])
def test_gptq(tmp_path: Path, sym: bool, desc_act: bool) -> None:
    group = 64
    tensors: dict[str, torch.Tensor] = {}
    dequantized = {}
    for name, t in read_tensors(FIXTURES / "llama-bf16").items():
        if not name.endswith("proj.weight"):
            tensors[name] = t
            continue
        w = t.float()
        k = w.shape[1]
        g_idx = act_order_g_idx(name, k, group) if desc_act else torch.arange(k) // group
        g_idx = g_idx.to(torch.int32)
        q, scale, zero = quantize(w, g_idx, k // group, sym)
        base = name[: -len(".weight")]
        tensors[base + ".qweight"] = pack_rows(q.t())
        tensors[base + ".qzeros"] = pack_cols((zero - 1).t(), list(range(8)))  # v1: minus one
        tensors[base + ".scales"] = scale.t().to(torch.float16)
        tensors[base + ".g_idx"] = g_idx
        s16 = scale.to(torch.float16).float()
        dequantized[name] = (q - zero[:, g_idx.long()]).float() * s16[:, g_idx.long()]
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym}
    check(write_checkpoint(tmp_path / "gptq", tensors, qc), dequantized, group)


def test_awq(tmp_path: Path) -> None:
    group = 64
    tensors: dict[str, torch.Tensor] = {}
    dequantized = {}
    for name, t in read_tensors(FIXTURES / "llama-bf16").items():
        if not name.endswith("proj.weight"):
            tensors[name] = t
            continue
        w = t.float()
        g_idx = torch.arange(w.shape[1]) // group
        q, scale, zero = quantize(w, g_idx, w.shape[1] // group, sym=False)
        base = name[: -len(".weight")]
        tensors[base + ".qweight"] = pack_cols(q.t(), AWQ_ORDER)  # [K, N / 8]
        tensors[base + ".qzeros"] = pack_cols(zero.t(), AWQ_ORDER)
        tensors[base + ".scales"] = scale.t().to(torch.float16)
        s16 = scale.to(torch.float16).float()
        dequantized[name] = (q - zero[:, g_idx]).float() * s16[:, g_idx]
    qc = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    check(write_checkpoint(tmp_path / "awq", tensors, qc), dequantized, group)


@pytest.mark.parametrize("fixture", ["llama-w4a16", "llama-fp8-block", "llama-fp8-dynamic"])
def test_dummy_weights_for_quantized_configs(fixture: str) -> None:
    """load_format="dummy" on a quantized config (the benchmarks' dummy Llama-3-8B)."""
    config = ModelConfig(model=str(FIXTURES / fixture), load_format="dummy", dtype="float32")
    logits = full_forward(load_model(config, CPU).model, IDS)
    assert logits.isfinite().all() and logits.abs().max() > 0
