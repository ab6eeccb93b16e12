"""The worker's adapter caches: max_loras device slots (LRU) over max_cpu_loras host copies.

A step may use at most max_loras adapters (the scheduler sees to it). Before the step's
forward, each of its adapters is put in a device slot: one already there is reused, else a
free slot or the least recently used slot no row of this step needs is overwritten from
the host copy, which is loaded from disk (and validated) on first use and kept in an LRU
of max_cpu_loras adapters.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from asyncserve.lora.adapter import LoRAWeights, load_adapter
from asyncserve.lora.layers import LoRABatch, LoRATargets, attach_lora, module_shapes
from asyncserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def _read_error(request: LoRARequest, exc: Exception) -> str:
    """One line naming the adapter and what went wrong reading it."""
    message = str(exc) or type(exc).__name__
    prefix = f"LoRA adapter {request.lora_name!r}: "
    if message.startswith(prefix):
        message = message[len(prefix) :]
    return f"LoRA adapter {request.lora_name!r} could not be read: {message}"


class LoRASlots:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.shapes = module_shapes(model)
        self.batch = LoRABatch(max_tokens, max_loras, device)
        self.targets: LoRATargets = attach_lora(model, self.batch, max_lora_rank)
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()
        # lora_int_id -> slot, least recently used first.
        self._slots: OrderedDict[int, int] = OrderedDict()
        # Unloaded adapters still used by some request: dropped once none uses them.
        self._unloaded: set[int] = set()

    @property
    def loaded_ids(self) -> list[int]:
        """Adapters in device slots, least recently used first."""
        return list(self._slots)

    @property
    def has_unloaded(self) -> bool:
        return bool(self._unloaded)

    def unload(self, lora_ids: set[int], in_use: set[int]) -> None:
        """Forget unloaded adapters once no request uses them (a running request keeps its
        weights, even if its files are gone)."""
        self._unloaded |= lora_ids
        for lora_id in self._unloaded - in_use:
            self.remove(lora_id)
        self._unloaded &= in_use

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: its slot frees, its host copy goes."""
        self._host.pop(lora_int_id, None)
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            self._clear(slot)

    def prepare(
        self, requests: Sequence[LoRARequest | None], counts: Sequence[int]
    ) -> dict[int, str]:
        """Put this step's adapters in slots and group its rows by slot (row order = the
        batch's: request i has counts[i] consecutive rows).

        Returns the adapters that could not be read (lora_int_id -> why): their rows run
        with no adapter, so the batch keeps its planned shape, and the caller voids them."""
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters, max_loras is {self.max_loras}")
        for lora_id in wanted:
            # In use: the last the host cache would drop.
            if lora_id in self._host:
                self._host.move_to_end(lora_id)
        slot_of: dict[int, int] = {}
        failed: dict[int, str] = {}
        for lora_id, request in wanted.items():
            try:
                slot_of[lora_id] = self._slot_for(request, wanted)
            except Exception as exc:  # a deleted or corrupted folder fails only its rows
                failed[lora_id] = _read_error(request, exc)
        per_request = np.asarray(
            [slot_of.get(r.lora_int_id, -1) if r is not None else -1 for r in requests],
            dtype=np.int32,
        )
        self.batch.set_rows(np.repeat(per_request, np.asarray(counts, dtype=np.int64)))
        return failed

    def _slot_for(self, request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        lora_id = request.lora_int_id
        slot = self._slots.get(lora_id)
        if slot is not None:
            self._slots.move_to_end(lora_id)
            return slot
        # Read first: an adapter that cannot be read takes no slot from another.
        weights = self._host_weights(request)
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slots if i not in wanted)
            slot = self._slots.pop(victim)
        self._write(slot, weights)
        self._slots[lora_id] = slot
        return slot

    def _host_weights(self, request: LoRARequest) -> LoRAWeights:
        lora_id = request.lora_int_id
        weights = self._host.get(lora_id)
        if weights is not None:
            self._host.move_to_end(lora_id)
            return weights
        start = time.perf_counter()
        # Pinned on a GPU, so a slot fill is an asynchronous copy behind the step in flight.
        weights = load_adapter(
            request.lora_name,
            request.lora_path,
            self.shapes,
            self.max_lora_rank,
            self.dtype,
            pin_memory=self.batch.device.type == "cuda",
        )
        self._host[lora_id] = weights
        # Read on the step thread, which waits meanwhile: a user sees when and how long, and
        # an adapter read again and again (host cache too small) shows up here.
        logger.info(
            "LoRA adapter %r (id %d, rank %d) read from %s in %.2f s; host cache %d/%d",
            request.lora_name, lora_id, weights.rank, request.lora_path,
            time.perf_counter() - start, min(len(self._host), self.max_cpu_loras),
            self.max_cpu_loras,
        )  # fmt: skip
        while len(self._host) > self.max_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            logger.info("LoRA adapter id %d dropped from the host cache (max_cpu_loras %d)",
                        dropped, self.max_cpu_loras)  # fmt: skip
        return weights

    def _clear(self, slot: int) -> None:
        for layer, index in self.targets.values():
            a, b = layer.stacks(index)
            a[slot].zero_()
            b[slot].zero_()

    def _write(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter into a slot; modules it does not target get zeros."""
        rank = weights.rank
        for key, (layer, index) in self.targets.items():
            a, b = layer.stacks(index)
            pair = weights.weights.get(key)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
                continue
            lora_a, lora_b = pair
            # This rank's share: its input columns of A, its output rows of B.
            s = layer.slices[index]
            lora_a = lora_a[:, layer.a_start : layer.a_start + layer.in_features]
            lora_b = lora_b[s.b_start : s.b_start + s.size]
            a[slot, rank:].zero_()
            b[slot, :, rank:].zero_()
            a[slot, :rank].copy_(lora_a, non_blocking=True)
            b[slot, :, :rank].copy_(lora_b, non_blocking=True)
