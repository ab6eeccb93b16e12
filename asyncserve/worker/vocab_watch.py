"""Which tensors of the full vocabulary's width a rank creates: a check that under tensor
parallelism only the driver (rank 0) materialises whole-vocabulary logits, the other ranks
holding their vocabulary slices only (models/parallel.py, gather_last_to_first).

A TorchDispatchMode sees every op this thread runs on the device or the CPU, so nothing
escapes it (sampling, prompt logprobs, speculative verification). It slows every op down:
a diagnostic, switched on and off through the runner (ModelRunner.watch_full_vocab).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FullVocabWatch(TorchDispatchMode):
    """Counts the op outputs whose last dim is the whole vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[-1] == self.vocab_size:
                self.count += 1
        return out


def switch_watch(
    watch: FullVocabWatch | None, on: bool, vocab_size: int
) -> tuple[FullVocabWatch | None, int]:
    """Start (on) or stop the watch on this thread: (the watch now running, its count)."""
    if on and watch is None:
        watch = FullVocabWatch(vocab_size)
        watch.__enter__()
    elif not on and watch is not None:
        watch.__exit__(None, None, None)
        return None, watch.count
    return watch, 0 if watch is None else watch.count
