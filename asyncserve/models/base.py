"""What the engine needs from a model, whatever its family."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.parallel import SINGLE, TensorParallel


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV cache: one (key, value) cache pair per layer.

    forward(input_ids, positions, kv_caches, meta) -> final hidden states [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32 on every rank;
    local_logits(hidden) -> [N, this rank's vocabulary slice] float32;
    load_weights(HF-named tensors) -> names of the parameters filled.
    """

    config: ArchConfig
    # This rank's place in the tensor-parallel group (one device for families without it).
    tp: TensorParallel = SINGLE

    def check_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"kv_caches must hold one (key, value) pair per layer "
                f"({self.config.num_hidden_layers}), got {len(kv_caches)}"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits (all of it on one device)."""
        return self.compute_logits(hidden)

    def driver_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab] float32 on the tensor-parallel driver (rank 0), which samples; None on
        the other ranks, which only send it their slices."""
        return self.tp.gather_last_to_first(self.local_logits(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise NotImplementedError

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, size) of the checkpoint tensor this rank needs; None: all of it."""
        return None

    def checkpoint_skips(self, hf_name: str) -> bool:
        """True when this rank needs nothing of the checkpoint tensor (another rank's
        expert), so that the reader need not read it."""
        return False
