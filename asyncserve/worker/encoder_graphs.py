"""CUDA graphs of a multimodal model's image encoder, for models whose encoder takes one fixed
pixel shape (LLaVA's CLIP / SigLIP towers: every image is resized to it).

One image's encoder is a few hundred small kernels: on an H200, CLIP ViT-L/14 at 336 pixels
keeps the GPU busy ~2 ms but launching its kernels eagerly took ~10 ms of host time, which a
lone request waited before its prefill could start. Graphs of 1, 2 and 4 images are captured
at start-up; a step's batch of new images is padded up to the next size (the padding rows'
outputs are dropped: images do not see each other in the encoder). Larger batches run
eagerly, where the launches are shared by the batch's images.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncserve.multimodal.inputs import MultiModalItem
from asyncserve.worker.cuda_graphs import padded_batch_size

logger = logging.getLogger(__name__)

ENCODER_GRAPH_SIZES = (1, 2, 4)


class EncoderGraphs:
    """`encode`: [B, *input_shape] pixels on the device -> [B, rows, hidden] embeddings."""

    def __init__(
        self,
        encode: Callable[[torch.Tensor], torch.Tensor],
        input_shape: tuple[int, ...],
        device: torch.device,
        sizes: tuple[int, ...] = ENCODER_GRAPH_SIZES,
    ) -> None:
        self.encode = encode
        self.sizes = list(sizes)
        self.input_shape = tuple(input_shape)
        # The graphs' input: the processors' float32 pixels, copied in before a replay.
        self.pixels = torch.zeros((self.sizes[-1], *input_shape), device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None
        self.device = device

    def capture_all(self) -> None:
        """Every size, largest first (the smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            pixels = self.pixels[:size]
            self.encode(pixels)  # kernels chosen and compiled outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = self.encode(pixels)
            self.graphs[size] = (graph, output)
        logger.info(
            "captured %d image encoder graphs (1 to %d images) in %.1f s",
            len(self.sizes), self.sizes[-1], time.perf_counter() - start,
        )  # fmt: skip

    def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor] | None:
        """One embeddings tensor per item by graph replay; None when the batch has no graph
        (too many images, or inputs other than pixels of the captured shape): the caller
        encodes it eagerly."""
        size = padded_batch_size(self.sizes, len(items))
        if size is None or not self.graphs:
            return None
        for item in items:
            values = item.data.get("pixel_values")
            if len(item.data) != 1 or values is None or tuple(values.shape) != self.input_shape:
                return None
        pixels = torch.stack([item.data["pixel_values"] for item in items])
        if self.device.type == "cuda" and pixels.device.type == "cpu":
            pixels = pixels.pin_memory()  # the copy then waits for no step in flight
        self.pixels[: len(items)].copy_(pixels, non_blocking=True)
        graph, output = self.graphs[size]
        graph.replay()
        # Out of the graph's buffer, which the next replay overwrites (the encoder cache
        # keeps these).
        return list(output[: len(items)].clone().unbind(0))
