"""Tensor-parallel weight slicing: each rank reads its slice of every sharded tensor."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import ModelConfig
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel, check_tensor_parallel
from tests.models.test_loader import TINY_CONFIG, random_state, write_config

CPU = torch.device("cpu")


def _load_rank(root: Path, rank: int) -> dict[str, torch.Tensor]:
    config = ModelConfig(model=str(root), dtype="float32")
    model = load_model(config, CPU, TensorParallel(rank, 2)).model
    return dict(model.named_parameters())


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_each_rank_holds_its_slice_of_one_layer(tmp_path: Path, num_kv_heads: int) -> None:
    state = random_state()
    head_dim = 8
    for name in ("k_proj", "v_proj"):  # fewer KV heads: keep the first ones
        key = f"model.layers.0.self_attn.{name}.weight"
        state[key] = state[key][: num_kv_heads * head_dim].contiguous()
        state[key.replace("layers.0", "layers.1")] = state[key].clone()
    root = write_config(tmp_path, num_key_value_heads=num_kv_heads)
    save_file(state, str(root / "model.safetensors"))
    p = "model.layers.0."
    kv_rows = head_dim * max(num_kv_heads // 2, 1)
    for rank in range(2):
        params = _load_rank(root, rank)
        q = state[p + "self_attn.q_proj.weight"].chunk(2)[rank]
        # One replicated head per rank when the ranks outnumber the KV heads.
        kv_start = rank * kv_rows if num_kv_heads >= 2 else 0
        k = state[p + "self_attn.k_proj.weight"][kv_start : kv_start + kv_rows]
        v = state[p + "self_attn.v_proj.weight"][kv_start : kv_start + kv_rows]
        torch.testing.assert_close(params[p + "self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
        o = state[p + "self_attn.o_proj.weight"].chunk(2, dim=1)[rank]
        torch.testing.assert_close(params[p + "self_attn.o_proj.weight"], o)
        gate = state[p + "mlp.gate_proj.weight"].chunk(2)[rank]
        up = state[p + "mlp.up_proj.weight"].chunk(2)[rank]
        torch.testing.assert_close(params[p + "mlp.gate_up_proj.weight"], torch.cat([gate, up]))
        down = state[p + "mlp.down_proj.weight"].chunk(2, dim=1)[rank]
        torch.testing.assert_close(params[p + "mlp.down_proj.weight"], down)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            torch.testing.assert_close(params[name], state[name].chunk(2)[rank])
        # Norms are replicated.
        torch.testing.assert_close(params["model.norm.weight"], state["model.norm.weight"])


def test_shapes_that_do_not_split_are_refused() -> None:
    arch = ArchConfig.from_hf_dict(TINY_CONFIG)
    check_tensor_parallel(arch, 2)
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(4\)"):
        check_tensor_parallel(arch, 3)
    odd_kv = {**TINY_CONFIG, "num_attention_heads": 6, "head_dim": 8, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match="KV heads"):
        check_tensor_parallel(ArchConfig.from_hf_dict(odd_kv), 2)
    # Every family registered today splits; one added without tensor parallelism is refused.
    other = dataclasses.replace(arch, architecture="OtherForCausalLM")
    with pytest.raises(ValueError, match="not supported for OtherForCausalLM"):
        check_tensor_parallel(other, 2)


def test_expert_parallel_needs_experts() -> None:
    dense = ArchConfig.from_hf_dict(TINY_CONFIG)
    for size in (1, 2):
        with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
            check_tensor_parallel(dense, size, expert_parallel=True)
    moe = {
        **TINY_CONFIG,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "intermediate_size": 63,
    }
    arch = ArchConfig.from_hf_dict(moe)
    # Whole experts place on two ranks; a 63-wide expert does not slice in two.
    check_tensor_parallel(arch, 2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"experts' intermediate size \(63\); or set enable_exp"):
        check_tensor_parallel(arch, 2)
    with pytest.raises(ValueError, match=r"at least one expert per rank: 2 experts"):
        check_tensor_parallel(arch, 4, expert_parallel=True)


def test_whole_tensors_are_sliced_on_load(tmp_path: Path) -> None:
    # Readers without slicing (GGUF) hand over whole tensors: the load slices them.
    state = random_state()
    root = write_config(tmp_path)
    save_file(state, str(root / "model.safetensors"))
    for rank in range(2):
        model = load_model(ModelConfig(model=str(root), dtype="float32"), CPU,
                           TensorParallel(rank, 2)).model  # fmt: skip
        sliced = {name: p.clone() for name, p in model.named_parameters()}
        model.load_weights((name, t.clone()) for name, t in state.items())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, sliced[name])
