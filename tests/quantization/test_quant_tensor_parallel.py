"""Quantized models under tensor parallelism: two gloo ranks, each holding its slice of the
quantized weights and of their scales, compute the same logits as one device (fp32
activations). Checkpoints: the llmcompressor fixtures (tests/fixtures/quantized), read as
two 64-wide heads instead of one 128-wide head so that two ranks can split them; the block
and group scales re-expressed losslessly at 64 columns (each scale repeated over the
sub-blocks it covers), so that each rank holds whole groups. Online `--quantization fp8` on
the fixtures' unquantized model."""

from __future__ import annotations

import json
import re
import shutil
import socket
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncserve.config import ModelConfig
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.weights import param_source
from asyncserve.quantization.base import set_weight_attrs
from tests.models.tp_ranks import logits
from tests.quantization.tp_quant_ranks import load, rank_main

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quantized"
# name -> (fixture, --quantization, scale granularity to re-express at 64 columns)
CASES = {
    "fp8-online": ("llama-bf16", "fp8", None),
    "fp8-channel": ("llama-fp8-dynamic", None, None),
    "fp8-block": ("llama-fp8-block", None, "block"),
    "w4a16": ("llama-w4a16", None, "group"),
}
# Per-token activation quantization (channel schemes) sees a row-parallel rank's half of
# each token's columns: its scale, so its e4m3 rounding, differ from one device's slightly.
CHANNEL_TOL = 0.06


def two_heads(src: Path, dst: Path, regroup: str | None = None) -> None:
    """`src` read as two 64-wide heads; with `regroup`, its 128-column block or group scales
    repeated at 64 columns (the same dequantized weights)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    tensors = load_file(str(dst / "model.safetensors"))
    if regroup is not None:
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
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))


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
    jobs = [(name, paths[name], CASES[name][1]) for name in CASES]
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


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_device(runs: Runs, name: str) -> None:
    expected = logits(load(runs.paths[name], SINGLE, CASES[name][1]), SINGLE)
    got = runs.tp2[name]
    if name in ("fp8-online", "fp8-channel"):
        span = (expected.max() - expected.min()).item()
        assert (got - expected).abs().max().item() <= CHANNEL_TOL * span, span
        agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
        assert agree >= 0.9
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
