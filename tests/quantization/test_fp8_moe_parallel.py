"""FP8 MoE experts over two gloo ranks: tensor parallelism (each rank a slice of every
expert's intermediate features, with its slice of the scales) and expert parallelism (whole
experts per rank) compute the logits of one device. A tiny two-head Qwen3-MoE: online
`--quantization fp8`, the llmcompressor FP8 channel fixture read as two 64-wide heads, and
an HF fp8 checkpoint with 32 x 32 blocks (a rank's 32 intermediate features: one block)."""

from __future__ import annotations

import json
import shutil
import socket
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncserve.models.parallel import SINGLE
from tests.kernels.test_moe_fp8 import quantize_experts
from tests.models.tp_ranks import logits
from tests.quantization.tp_quant_ranks import load, rank_main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quantized"
# (checkpoint, --quantization, expert_parallel)
CASES = {
    "online-tp": ("bf16", "fp8", False),
    "online-ep": ("bf16", "fp8", True),
    "channel-tp": ("channel", None, False),
    "block-tp": ("block", None, False),
    "block-ep": ("block", None, True),
}
# Per-token activation quantization sees a row-parallel rank's half of each token's columns
# (o_proj, the experts' down projection): its scale, so its rounding, differ from one
# device's; block scales (one activation group per block) are exact.
CHANNEL_TOL = 0.06
# The random routers' top-2 choices are near ties that one e4m3 rounding flips (moving that
# token's logits by ~15% of their span); sharper routers keep the choices apart.
ROUTER_GAIN = 8.0


def two_heads(dst: Path, fixture: str) -> Path:
    """A qwen3moe fixture read as two 64-wide heads (q/k norms cut to 64)."""
    shutil.copytree(FIXTURES / fixture, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        tensors[name] = tensors[name][:64]
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name] = tensors[name] * ROUTER_GAIN
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def hf_fp8_block(dst: Path, bf16: Path) -> Path:
    """Every projection of `bf16` in HF's fp8 layout with 32 x 32 blocks."""
    shutil.copytree(bf16, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        q, s = quantize_experts(tensors[name].float()[None], (32, 32), 1)
        tensors[name], tensors[name + "_scale_inv"] = q[0], s[0]
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict]:  # type: ignore[type-arg]
    root = tmp_path_factory.mktemp("moe_tp")
    bf16 = two_heads(root / "bf16", "qwen3moe-bf16")
    paths = {
        "bf16": str(bf16),
        "channel": str(two_heads(root / "channel", "qwen3moe-fp8-dynamic")),
        "block": str(hf_fp8_block(root / "block", bf16)),
    }
    jobs = [(name, paths[ckpt], q, ep) for name, (ckpt, q, ep) in CASES.items()]
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
    return paths, tp2


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_one_device(runs, name: str) -> None:  # type: ignore[no-untyped-def]
    paths, tp2 = runs
    checkpoint, quantization, _ = CASES[name]
    expected = logits(load(paths[checkpoint], SINGLE, quantization), SINGLE)
    got = tp2[name]
    if checkpoint == "block":
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:
        span = (expected.max() - expected.min()).item()
        assert (got - expected).abs().max().item() <= CHANNEL_TOL * span
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
