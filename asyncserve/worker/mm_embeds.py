"""The multimodal part of a step on the worker: image embeddings over placeholder rows, and
model-provided positions (M-RoPE).

A step that schedules no prompt token of a request with images (every pure-decode step, and
text-only prefills) has no image rows, and each token's three M-RoPE rows are equal
(index + delta): M-RoPE is plain RoPE there, so such a step takes [T] positions and fits the
captured decode graphs.

Chunked prefill may cut a prompt inside an image's placeholder run. As in vLLM, the whole
image is encoded when a step first reaches any of its placeholder positions and the step
takes the rows it covers; the embeddings stay in the encoder cache (keyed by the image's
hash) for the chunks that follow, and for any later request with the same image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncserve.models.multimodal import host_to_device
from asyncserve.multimodal.inputs import MultiModalItem
from asyncserve.worker.encoder_cache import EncoderCache
from asyncserve.worker.encoder_graphs import EncoderGraphs

if TYPE_CHECKING:
    from asyncserve.models.multimodal import MultiModalCausalLM
    from asyncserve.worker.input_batch import CachedRequestState, StepInputs


class StepEmbedder:
    def __init__(self, model: MultiModalCausalLM, cache: EncoderCache) -> None:
        self.model = model
        self.cache = cache
        # The encoder's CUDA graphs, once captured (capture_encoder_graphs).
        self.graphs: EncoderGraphs | None = None

    def capture_encoder_graphs(self, device: torch.device) -> None:
        """Capture the encoder's graphs when its input has one shape (see encoder_graphs.py)."""
        shape = self.model.encoder_input_shape()
        if shape is not None:
            graphs = EncoderGraphs(self.model.encode_pixels, shape, device)
            graphs.capture_all()
            self.graphs = graphs

    def inputs_embeds(
        self, inputs: StepInputs, states: dict[str, CachedRequestState]
    ) -> torch.Tensor | None:
        """[T, hidden] input embeddings with the image rows written in, or None when no
        scheduled token of this step is an image placeholder (the plain forward then)."""
        # (flat row range, item, item row range) of every placeholder run this step covers.
        pieces: list[tuple[int, int, MultiModalItem, int]] = []
        base = 0
        for rid, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
            features = states[rid].mm_features
            if features is not None:
                end = start + count
                for item in features.items:
                    lo, hi = max(start, item.offset), min(end, item.end)
                    if lo < hi:
                        pieces.append((base + lo - start, hi - lo, item, lo - item.offset))
            base += count
        if not pieces:
            return None
        encoded = self._encode([item for _, _, item, _ in pieces])
        embeds = self.model.embed_input_ids(inputs.input_ids)
        rows = torch.cat([torch.arange(at, at + n) for at, n, _, _ in pieces])
        values = torch.cat([encoded[item.hash][first : first + n] for _, n, item, first in pieces])
        embeds[host_to_device(rows, embeds.device)] = values.to(embeds.dtype)
        return embeds

    def _encode(self, items: list[MultiModalItem]) -> dict[str, torch.Tensor]:
        """Every item's embeddings: from the cache, or encoded in one batch."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalItem] = {}
        for item in items:
            if item.hash in found or item.hash in missing:
                continue
            cached = self.cache.get(item.hash)
            if cached is not None:
                found[item.hash] = cached
            else:
                missing[item.hash] = item
        if missing:
            todo = list(missing.values())
            outputs = self.graphs.encode_items(todo) if self.graphs is not None else None
            if outputs is None:
                outputs = self.model.embed_images(todo)
            for item, out in zip(todo, outputs, strict=True):
                if out.shape[0] != item.length:
                    raise RuntimeError(
                        f"the model encoded an image into {out.shape[0]} rows; its "
                        f"placeholder run has {item.length}"
                    )
                found[item.hash] = out
                self.cache.put(item.hash, out)
            self.cache.num_encoded += len(todo)
        return found


def mrope_positions(inputs: StepInputs, states: dict[str, CachedRequestState]) -> torch.Tensor:
    """[3, T] positions: the processor's rows for prompt tokens of requests that have them,
    index + delta on every row past the prompt, the plain position elsewhere."""
    out = inputs.positions.unsqueeze(0).expand(3, -1).clone()
    columns: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    base = 0
    for rid, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
        state = states[rid]
        features = state.mm_features
        if features is not None and (
            features.mrope_positions is not None or features.mrope_position_delta
        ):
            end = start + count
            num_prompt = len(state.prompt_token_ids)
            rows = torch.arange(start, end, dtype=torch.int64) + features.mrope_position_delta
            rows = rows.unsqueeze(0).repeat(3, 1)
            if features.mrope_positions is not None and start < num_prompt:
                upto = min(end, num_prompt)
                rows[:, : upto - start] = features.mrope_positions[:, start:upto]
            columns.append(torch.arange(base, base + count))
            values.append(rows)
        base += count
    if values:  # one copy for the step's rows, not one per request
        out[:, host_to_device(torch.cat(columns), out.device)] = host_to_device(
            torch.cat(values, dim=1), out.device
        )
    return out


def past_image_prompts(inputs: StepInputs, states: dict[str, CachedRequestState]) -> bool:
    """Whether no request of this step schedules a prompt token of a request with images."""
    for rid, start in zip(inputs.request_ids, inputs.starts, strict=True):
        state = states[rid]
        if state.mm_features is not None and start < len(state.prompt_token_ids):
            return False
    return True


def mrope_plain_positions(
    inputs: StepInputs, states: dict[str, CachedRequestState]
) -> torch.Tensor:
    """[T] positions (index + delta) of a step past every image prompt: the one value that
    all three M-RoPE rows hold there."""
    deltas = [
        features.mrope_position_delta if (features := states[rid].mm_features) else 0
        for rid in inputs.request_ids
    ]
    if not any(deltas):
        return inputs.positions
    per_token = torch.tensor(deltas, dtype=torch.int64).repeat_interleave(
        torch.tensor(inputs.counts)
    )
    return inputs.positions + host_to_device(per_token, inputs.positions.device)


def step_mrope_positions(inputs: StepInputs, states: dict[str, CachedRequestState]) -> torch.Tensor:
    """[T] positions when the step is past every image prompt, else the [3, T] rows."""
    if past_image_prompts(inputs, states):
        return mrope_plain_positions(inputs, states)
    return mrope_positions(inputs, states)
