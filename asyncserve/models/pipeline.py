"""Pipeline parallelism: which layers a stage holds, and the hand-over between stages.

The world of tensor_parallel_size x pipeline_parallel_size ranks is laid out stage by stage
(global rank = stage * tp + tp_rank). Stage s holds a contiguous run of layers (and their
KV cache); its ranks receive the hidden states and residual from the same tensor-parallel
rank of stage s - 1 and send theirs to stage s + 1 (point-to-point over the world group).
The last stage's first rank samples; the other stages learn the sampled ids from the
engine's next plan (core/micro_batches.py), so a stage never waits for the ones after it and
runs the next step's micro-batch while they run this one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: equal runs, the first stages one longer."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({num_stages}) exceeds the number of layers ({num_layers})"
        )
    per, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + per + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage: its layers [start, end) and its neighbours' global ranks."""

    stage: int
    num_stages: int
    start: int
    end: int
    # Global ranks: the same tensor-parallel rank one stage back / ahead.
    prev_rank: int
    next_rank: int
    # The last hand-over still being sent (its works, and its tensors kept alive until
    # then): a stage goes on to its next micro-batch while the next stage is still busy.
    _works: list[Any] = field(default_factory=list, compare=False, repr=False)
    _sending: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(cls, rank: int, tp_size: int, num_stages: int, num_layers: int) -> PipelineStage:
        stage = rank // tp_size
        start, end = split_layers(num_layers, num_stages)[stage]
        return cls(
            stage=stage,
            num_stages=num_stages,
            start=start,
            end=end,
            prev_rank=rank - tp_size,
            next_rank=rank + tp_size,
        )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def holds_tensor(self, hf_name: str) -> bool:
        """Whether this stage reads a checkpoint tensor: a layer's only on its stage (the
        embedding, final norm and head are read everywhere)."""
        if not hf_name.startswith("model.layers."):
            return True
        return self.holds(int(hf_name.split(".")[2]))

    def recv(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual), each shaped and typed like `like`."""
        hidden, residual = torch.empty_like(like), torch.empty_like(like)
        dist.recv(hidden, src=self.prev_rank)
        dist.recv(residual, src=self.prev_rank)
        return hidden, residual

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Start sending (hidden, residual) to the next stage; the send before is waited
        for first (the messages between two ranks arrive in order)."""
        self.wait_sent()
        tensors = [hidden.contiguous(), residual.contiguous()]
        self._works.extend(dist.isend(t, dst=self.next_rank) for t in tensors)
        self._sending.extend(tensors)

    def wait_sent(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._sending.clear()


class MissingLayer(nn.Module):
    """A layer another stage holds: no parameters, never run here."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this layer belongs to another pipeline stage")
