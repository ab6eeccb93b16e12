"""cuBLAS's first call of each GEMM shape, made on a thread beside the start-up pass.

The first GEMM of a shape a process has not run before costs milliseconds of host time:
cuBLAS chooses a kernel and CUDA loads it (lazy module loading). The start-up forwards meet
about a hundred such shapes (the profile step's, the LM head's, every decode graph size's):
0.6 s of the compile pass's forwards on an H200 (py-spy over a cold start). Torch drops the
GIL inside a GEMM, so a thread running the same shapes on a stream of its own loads their
kernels while the forwards' Python runs; the forwards then find them loaded (a loaded
kernel is the process's, whichever thread loaded it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.models.layers import Linear, LMHead, VocabEmbedding

logger = logging.getLogger(__name__)


def dense_weights(model: nn.Module) -> list[torch.Tensor]:
    """One weight of each distinct shape the model multiplies with F.linear: its unquantized
    Linear layers and the LM head."""
    seen: set[tuple[tuple[int, ...], torch.dtype]] = set()
    weights: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            continue
        if not isinstance(module, Linear | LMHead | VocabEmbedding):
            continue
        weight = module.weight
        key = (tuple(weight.shape), weight.dtype)
        if weight.dim() != 2 or weight.is_meta or key in seen:
            continue
        seen.add(key)
        weights.append(weight)
    return weights


class GemmWarmUp:
    """Runs F.linear for every weight shape at each row count (the decode steps' batch sizes:
    small, so the device memory it takes beside the forwards' is too), on its own thread and
    stream; `join` waits for it (before anything measures the device's memory)."""

    def __init__(self, model: nn.Module, row_counts: Iterable[int], device: torch.device) -> None:
        self.weights = dense_weights(model)
        self.row_counts = sorted(set(row_counts), reverse=True)
        self.device = device
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gemm-warm-up", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream), torch.inference_mode():
                for weight in self.weights:
                    rows = torch.zeros(
                        (self.row_counts[0], weight.shape[1]), dtype=weight.dtype,
                        device=self.device,
                    )  # fmt: skip
                    for count in self.row_counts:
                        F.linear(rows[:count], weight)
                    del rows
            stream.synchronize()
        except Exception as error:  # a warm-up only: the forwards make these calls anyway
            self.error = error
        logger.debug(
            "GEMM warm-up: %d shapes x %d row counts in %.2f s",
            len(self.weights), len(self.row_counts), time.perf_counter() - start,
        )  # fmt: skip

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            logger.debug("GEMM warm-up stopped: %r", self.error)
