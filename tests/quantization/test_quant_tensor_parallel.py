"""Quantized models under tensor parallelism: two gloo ranks, each holding its slice of the
quantized weights and of their scales, compute the same logits as one device (fp32
activations). Checkpoints: the llmcompressor and AutoRound fixtures
(tests/fixtures/quantized), read as two 64-wide heads instead of one 128-wide head so that
two ranks can split them; the block and group scales re-expressed losslessly at 64 columns
(each scale repeated over the sub-blocks it covers), so that each rank holds whole groups.
Online `--quantization fp8`, HF per-tensor FP8, GPTQ and AWQ, and GPTQ and compressed-tensors
W4A16 with act order (g_idx) on the fixtures' unquantized model. A group or block that a
rank's slice would cut is a one-line error. GGUF files kept quantized (`quantization="gguf"`)
slice whole blocks; a row-parallel layer whose per-rank inputs are not whole blocks is
dequantized at load."""

from __future__ import annotations

import json
import re
import shutil
import socket
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from asyncserve import LLM, SamplingParams
from asyncserve.config import ModelConfig
from asyncserve.kernels.quant_reference import FP8_DTYPE
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.weights import param_source
from asyncserve.quantization.base import set_weight_attrs
from asyncserve.quantization.gguf import GGUFLinearMethod
from tests.models.tp_ranks import logits
from tests.quantization.test_gguf_quantized import gguf_linear, write_gguf
from tests.quantization.test_int4_checkpoints import (
    AWQ_ORDER,
    act_order_g_idx,
    compressed_tensors_act_order,
    pack_cols,
    pack_rows,
    quantize,
)
from tests.quantization.tp_quant_ranks import load, rank_main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quantized"
# name -> (fixture, --quantization, scale granularity to re-express at 64 columns)
CASES: dict[str, tuple[str, str | None, str | None]] = {
    "fp8-online": ("llama-bf16", "fp8", None),
    "fp8-channel": ("llama-fp8-dynamic", None, None),
    "fp8-block": ("llama-fp8-block", None, "block"),
    "w4a16": ("llama-w4a16", None, "group"),
    "gptq-autoround": ("llama-gptq", None, None),  # group 64 already
    # Written here from the unquantized model in the published layouts (as in
    # test_fp8_checkpoints.py and test_int4_checkpoints.py).
    "fp8-per-tensor": ("llama-bf16", None, "hf-fp8"),
    "gptq": ("llama-bf16", None, "gptq"),
    # Act order: a row-parallel rank's columns draw on every group (scattered by g_idx).
    "gptq-act-order": ("llama-bf16", None, "gptq-act-order"),
    "w4a16-act-order": ("llama-bf16", None, "ct-act-order"),  # compressed-tensors "group"
    "awq": ("llama-bf16", None, "awq"),
}
# Per-token activation quantization (channel and per-tensor FP8) sees a row-parallel rank's
# half of each token's columns: its scale, so its e4m3 rounding, differ from one device's
# (a few percent of the logits' span, as against the dequantized model).
CHANNEL = ("fp8-online", "fp8-channel", "fp8-per-tensor")
CHANNEL_TOL = 0.06
CHANNEL_MEAN_TOL = 0.01
GROUP = 64  # of the GPTQ / AWQ checkpoints: a row-parallel rank's 64 columns hold one
# Tiny GGUF Llamas (tests/quantization/test_gguf_quantized.py), name -> (type, hidden size):
# Q8_0 at 64 (o_proj: 32 inputs per rank, one block; down_proj: 48, dequantized) and Q4_K at
# 512 (256 inputs per rank: one super-block each).
GGUF_CASES = {"gguf-q8_0": (T.Q8_0, 64), "gguf-q4_k": (T.Q4_K, 512)}


def two_heads(src: Path, dst: Path, regroup: str | None = None) -> None:
    """`src` read as two 64-wide heads; with `regroup` "block" / "group", its 128-column
    block or group scales repeated at 64 columns (the same dequantized weights); with
    "hf-fp8" / "gptq" / "gptq-act-order" / "awq" / "ct-act-order", its weights quantized
    in that format."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    tensors = load_file(str(dst / "model.safetensors"))
    if regroup in ("block", "group"):
        group = config["quantization_config"]["config_groups"]["group_0"]
        if regroup == "block":
            group["weights"]["block_structure"] = [64, 64]
            group["input_activations"]["group_size"] = 64
        else:
            group["weights"]["group_size"] = 64
        for name, t in tensors.items():
            if name.endswith(".weight_scale"):
                t = t.repeat_interleave(2, dim=1)
                tensors[name] = t.repeat_interleave(2, dim=0) if regroup == "block" else t
    elif regroup == "ct-act-order":
        tensors, config["quantization_config"], _ = compressed_tensors_act_order(tensors, GROUP)
    elif regroup is not None:
        tensors, config["quantization_config"] = quantized(tensors, regroup)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))


def quantized(
    tensors: dict[str, torch.Tensor], scheme: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The projections of an unquantized checkpoint in HF fp8 per-tensor, GPTQ or AWQ."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            out[name] = t
            continue
        w, base = t.float(), name[: -len(".weight")]
        if scheme == "hf-fp8":
            scale = w.abs().max() / 448
            out[name], out[name + "_scale"] = (w / scale).to(FP8_DTYPE), scale.reshape(())
            continue
        g_idx = torch.arange(w.shape[1]) // GROUP
        if scheme == "gptq-act-order":
            g_idx = act_order_g_idx(name, w.shape[1], GROUP)
        q, scale, zero = quantize(w, g_idx, w.shape[1] // GROUP, sym=scheme != "awq")
        if scheme != "awq":
            out[base + ".qweight"] = pack_rows(q.t())
            out[base + ".qzeros"] = pack_cols((zero - 1).t(), list(range(8)))
            out[base + ".g_idx"] = g_idx.to(torch.int32)
        else:
            out[base + ".qweight"] = pack_cols(q.t(), AWQ_ORDER)
            out[base + ".qzeros"] = pack_cols(zero.t(), AWQ_ORDER)
        out[base + ".scales"] = scale.t().to(torch.float16)
    if scheme == "hf-fp8":
        return out, {"quant_method": "fp8", "activation_scheme": "dynamic"}
    qc: dict[str, Any] = {"quant_method": scheme, "bits": 4, "group_size": GROUP}
    if scheme == "awq":
        return out, {**qc, "zero_point": True, "version": "gemm"}
    desc_act = scheme == "gptq-act-order"
    return out, {**qc, "quant_method": "gptq", "desc_act": desc_act, "sym": True}


@dataclass
class Runs:
    paths: dict[str, str]
    tp2: dict[str, torch.Tensor]  # rank 0's logits with two ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("quant_tp")
    paths = {}
    for name, (fixture, _, regroup) in CASES.items():
        two_heads(FIXTURES / fixture, root / name, regroup)
        paths[name] = str(root / name)
    for name, (qtype, width) in GGUF_CASES.items():
        paths[name] = str(write_gguf(root / f"{name}.gguf", gguf_linear(qtype), width))
    jobs = [(name, paths[name], CASES[name][1]) for name in CASES]
    jobs += [(name, paths[name], "gguf") for name in GGUF_CASES]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, f"tcp://127.0.0.1:{port}", jobs, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    tp2 = {}
    try:
        for _ in jobs:
            name, out = queue.get(timeout=120)
            tp2[name] = out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return Runs(paths, tp2)


@pytest.mark.parametrize("name", [*CASES, *GGUF_CASES])
def test_two_ranks_equal_one_device(runs: Runs, name: str) -> None:
    quantization = CASES[name][1] if name in CASES else "gguf"
    expected = logits(load(runs.paths[name], SINGLE, quantization), SINGLE)
    got = runs.tp2[name]
    if name in CHANNEL:
        # Within the activation rounding (a wrong slice or scale is off by the logits' span).
        span = (expected.max() - expected.min()).item()
        diff = (got - expected).abs()
        assert diff.max().item() <= CHANNEL_TOL * span
        assert diff.mean().item() <= CHANNEL_MEAN_TOL * span
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    ("fixture", "message"),
    [
        ("llama-w4a16", "not a multiple of the quantization group size (128)"),
        ("llama-fp8-block", "not a multiple of the quantization block's columns (128)"),
    ],
)
def test_groups_that_straddle_ranks_are_refused(tmp_path: Path, fixture: str, message: str) -> None:
    two_heads(FIXTURES / fixture, tmp_path / "model")
    config = ModelConfig(model=str(tmp_path / "model"), dtype="float32")
    with pytest.raises(ValueError, match=re.escape(message)):
        # Refused while building, before any collective: no process group needed.
        load_model(config, torch.device("cpu"), TensorParallel(0, 2))


def test_gguf_row_parallel_layers_cut_inside_blocks_are_dequantized(
    runs: Runs, caplog: pytest.LogCaptureFixture
) -> None:
    """Q8_0 at hidden 64 under two ranks: o_proj's 32 inputs per rank are one block (kept,
    this rank's blocks only); down_proj's 48 are not whole blocks (dequantized, logged)."""
    config = ModelConfig(model=runs.paths["gguf-q8_0"], dtype="float32", quantization="gguf")
    with caplog.at_level("INFO", logger="asyncserve.quantization.gguf"):
        # Reading GGUF slices needs no collective: no process group.
        model = load_model(config, torch.device("cpu"), TensorParallel(0, 2)).model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj.quant_method, GGUFLinearMethod)
    assert layer.self_attn.o_proj.gguf_qweight.shape == (64, 32)
    assert isinstance(layer.mlp.gate_up_proj.quant_method, GGUFLinearMethod)
    assert layer.mlp.down_proj.quant_method is None
    assert layer.mlp.down_proj.weight.shape == (64, 48)
    assert "down_proj: 48 input columns are not whole Q8_0 blocks of 32" in caplog.text


def test_gptq_act_order_rank_keeps_every_group(runs: Runs) -> None:
    """A row-parallel rank of an act-order checkpoint: its 64 columns of the packed weight
    and of g_idx, every group's scales and zeros (its columns draw on both groups)."""
    config = ModelConfig(model=runs.paths["gptq-act-order"], dtype="float32")
    # Loading 4-bit slices needs no collective: no process group.
    model = load_model(config, torch.device("cpu"), TensorParallel(1, 2)).model
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.w4_qweight.shape == (128, 64 // 8)
    assert o_proj.w4_scales.shape == (128, 128 // GROUP)
    assert o_proj.w4_zeros is None  # symmetric GPTQ: every zero 8, none kept
    g_idx = load_file(str(Path(runs.paths["gptq-act-order"]) / "model.safetensors"))[
        "model.layers.0.self_attn.o_proj.g_idx"
    ]
    assert torch.equal(o_proj.w4_g_idx, g_idx[64:])
    assert set(g_idx[64:].tolist()) == {0, 1}


def test_slices_in_a_quantized_layout() -> None:
    """A rank's slice in the layouts' own coordinates: GPTQ's packed qweight runs along the
    inputs in dim 0, eight per entry; a block scale holds one entry per block."""
    qweight = set_weight_attrs(torch.nn.Parameter(torch.empty(0)), 1, 1, False, 0, 8)
    assert param_source(qweight, (1, 64, 64), "qweight", 16) == (0, 8, 8)
    assert param_source(qweight, (0, 32, 32), "qweight", 64) == (1, 32, 32)
    block = set_weight_attrs(torch.nn.Parameter(torch.empty(0)), 0, 64, False, 1, 64)
    assert param_source(block, (0, 64, 64), "scale", 2) == (0, 1, 1)
    assert param_source(block, (0, 64, 32), "scale", 2) == (0, 1, 1)  # the last rank's
    with pytest.raises(ValueError, match="inside its 64-output row quantization groups"):
        param_source(block, (0, 32, 32), "scale", 2)
    channel = set_weight_attrs(torch.nn.Parameter(torch.empty(0)), in_dim=-1)
    assert param_source(channel, (1, 64, 64), "weight_scale", 1) is None


def test_engine_with_two_ranks_generates_as_one_device(tmp_path: Path) -> None:
    """Through the engine and its worker processes: a 4-bit checkpoint's greedy tokens."""
    two_heads(FIXTURES / "llama-w4a16", tmp_path / "model", "group")
    args: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_model_len": 64}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts: list[Any] = [
        {"prompt_token_ids": [3 + 11 * i + j for j in range(9)]} for i in range(3)
    ]
    tokens = []
    for size in (1, 2):
        llm = LLM(str(tmp_path / "model"), tensor_parallel_size=size, **args)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
        tokens.append([list(out.outputs[0].token_ids) for out in outs])
    assert tokens[1] == tokens[0]
