"""SparseMoE: expert placement by rank, loading only local experts, partial sums that add up."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels.ops import REFERENCE_OPS
from asyncserve.models.arch_config import MoEArch
from asyncserve.models.moe import ExpertPlacement, SparseMoE, expert_target
from asyncserve.models.weights import Target, load_checkpoint

MOE = MoEArch(num_experts=6, top_k=2, intermediate_size=8, renormalize=True)
HIDDEN = 16


def test_placements() -> None:
    assert ExpertPlacement().local_experts(6) == list(range(6))
    assert ExpertPlacement(1, 4).local_experts(6) == [1, 5]
    assert ExpertPlacement(1, 4, "contiguous").local_experts(6) == [2, 3]
    assert ExpertPlacement(0, 4, "contiguous").local_experts(6) == [0, 1]
    with pytest.raises(ValueError, match="rank"):
        ExpertPlacement(2, 2)


def _checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {"mlp.gate.weight": torch.randn(MOE.num_experts, HIDDEN, generator=gen)}
    for e in range(MOE.num_experts):
        for proj, shape in (("gate", (8, HIDDEN)), ("up", (8, HIDDEN)), ("down", (HIDDEN, 8))):
            state[f"mlp.experts.{e}.{proj}"] = torch.randn(*shape, generator=gen) / 4
    return state


def _load(placement: ExpertPlacement | None) -> SparseMoE:
    layer = SparseMoE(HIDDEN, MOE, REFERENCE_OPS, placement)
    holder = torch.nn.Module()
    holder.mlp = layer

    def route(name: str) -> Target | None:
        if name == "mlp.gate.weight":
            return Target(name)
        _, _, expert, proj = name.split(".")
        return expert_target(layer, "mlp", proj, int(expert))

    load_checkpoint(holder, _checkpoint().items(), route)
    return layer


def test_ranks_hold_their_experts_and_partial_sums_add_up() -> None:
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    full = _load(None)
    assert full.expert_map is None and full.w13.shape[0] == 6
    expected = full(x)
    total = torch.zeros_like(expected)
    for rank in range(2):
        part = _load(ExpertPlacement(rank, 2, "contiguous"))
        assert part.w13.shape[0] == 3 and part.expert_map is not None
        torch.testing.assert_close(part.w13, full.w13[rank * 3 : rank * 3 + 3])
        total += part(x)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=0)
    # Each rank's share alone is not the layer's output: the reduce hook must sum them.
    assert not torch.allclose(part(x), expected, atol=1e-3)


def test_expert_weights_for_a_dense_layer_are_rejected() -> None:
    with pytest.raises(ValueError, match="dense MLP"):
        expert_target(torch.nn.Linear(2, 2), "model.layers.0.mlp", "gate", 0)


def test_kernel_warm_up_sizes_are_the_same_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up MoE passes come from the config alone (every rank runs the same ones);
    none off CUDA, without MoE, or with experts split unevenly over the ranks."""
    from asyncserve.kernels.moe_config import config_change_sizes
    from asyncserve.models import moe as moe_module

    h100 = "NVIDIA_H100_80GB_HBM3"
    monkeypatch.setattr(moe_module, "device_name", lambda device: h100)
    # Qwen3-30B-A3B's experts: the H100 has a tuned table for them at one rank.
    arch = MoEArch(num_experts=128, top_k=8, intermediate_size=768, renormalize=True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    sizes = moe_module.kernel_warm_up_sizes
    assert sizes(arch, 2, False, 16383, bf16, cuda) == config_change_sizes(
        16383, 128, 384, "bfloat16", h100
    )
    assert sizes(arch, 2, True, 16383, bf16, cuda) == config_change_sizes(
        16383, 64, 768, "bfloat16", h100
    )
    assert len(sizes(arch, 1, False, 16383, bf16, cuda)) > 5
    assert sizes(arch, 3, True, 16383, bf16, cuda) == []  # 128 experts over 3 ranks
    assert sizes(None, 1, False, 16383, bf16, cuda) == []
    assert sizes(arch, 1, False, 16383, bf16, torch.device("cpu")) == []
