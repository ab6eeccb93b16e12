"""The LoRA layer and the slot caches: a wrapped projection equals base + x A^T B^T per row
(with the reference ops and with the Triton kernels), slots evict least recently used ones
that the step does not need, the host cache keeps max_cpu_loras adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.lora.layers import LoRABatch, LoRALinear, LoRASlice
from asyncserve.lora.request import LoRARequest
from asyncserve.lora.slots import LoRASlots
from asyncserve.models.layers import Linear
from asyncserve.models.loader import load_model
from tests.lora.conftest import TinyLoRA


def _layer(batch: LoRABatch) -> LoRALinear:
    gen = torch.Generator().manual_seed(0)
    base = Linear(24, 20)
    base.weight.copy_(torch.randn(20, 24, generator=gen))
    layer = LoRALinear(base, [LoRASlice("q_proj", 0, 12), LoRASlice("k_proj", 12, 8)], batch, 4)
    for i in range(2):
        a, b = layer.stacks(i)
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(torch.randn(b.shape, generator=gen))
    return layer


@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_lora_linear_rows(ops: str) -> None:
    batch = LoRABatch(16, 2, torch.device("cpu"))
    if ops == "triton":
        pytest.importorskip("triton")
        from asyncserve.kernels import lora

        batch.shrink, batch.expand = lora.lora_shrink, lora.lora_expand
    layer = _layer(batch)
    slots = [1, -1, 0, 0, 1, -1]
    batch.set_rows(np.asarray(slots, dtype=np.int32))
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    for row, slot in enumerate(slots):
        expected = x[row] @ layer.base.weight.T
        if slot >= 0:
            for i, s in enumerate(layer.slices):
                a, b = layer.stacks(i)
                expected[s.offset : s.offset + s.size] += x[row] @ a[slot].T @ b[slot].T
        torch.testing.assert_close(y[row], expected, atol=1e-4, rtol=1e-4)
    # No adapter in the step: the base layer alone.
    batch.set_rows(np.asarray([-1] * 6, dtype=np.int32))
    assert not batch.active
    torch.testing.assert_close(layer(x), x @ layer.base.weight.T)


def test_slots_lru_and_host_cache(tiny_lora: TinyLoRA) -> None:
    loaded = load_model(
        ModelConfig(model=str(tiny_lora.base_path), dtype="float32"), torch.device("cpu")
    )
    slots = LoRASlots(loaded.model, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                      max_tokens=64, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    a, b, c = (
        LoRARequest(f"ad{i}", i + 1, str(ad.path)) for i, ad in enumerate(tiny_lora.adapters)
    )
    slots.prepare([a, None, b], [3, 2, 1])
    assert slots.loaded_ids == [1, 2]
    assert slots.batch.active
    slots.prepare([a], [1])  # a becomes the most recent
    assert slots.loaded_ids == [2, 1]
    slots.prepare([c, a], [1, 1])  # c evicts b, the least recent one not in this step
    assert slots.loaded_ids == [3, 1]
    assert list(slots._host) == [1, 3]  # b's host copy went too (capacity 2)
    # c targets no q/k/v: its slot holds zeros there; a's q_proj holds its weights.
    layer, index = slots.targets[(0, "q_proj")]
    qa, qb = layer.stacks(index)
    slot_a, slot_c = slots._slots[1], slots._slots[3]
    assert not qa[slot_c].any() and not qb[slot_c].any()
    assert qa[slot_a, :8].any() and not qa[slot_a, 8:].any()  # rank 8 padded to 16
    slots.unload({3}, in_use={3})  # still running: kept
    assert slots.loaded_ids == [3, 1] and slots.has_unloaded
    slots.unload(set(), in_use=set())  # its requests are done: dropped
    assert slots.loaded_ids == [1] and not slots.has_unloaded
    assert 3 not in slots._host
    with pytest.raises(RuntimeError, match="max_loras"):
        slots.prepare([a, b, c], [1, 1, 1])
