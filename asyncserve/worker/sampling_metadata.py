"""One step's sampling parameters as batched device tensors.

Built once per step from the host-side rows. Every feature that no row uses stays None, so a
batch that does not use it pays nothing in the sampler. Each tensor crosses to the device in
one transfer (from pinned memory, without blocking, on CUDA); nothing here reads a device
value back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.sampling_columns import NO_LOGPROBS, BatchColumns


@dataclass
class SamplingRow:
    """What the sampler needs to know of one request in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Seeded from params.seed by the runner, on the runner's device; None for unseeded rows.
    generator: torch.Generator | None
    # EOS and params.stop_token_ids: masked out while the output is shorter than min_tokens.
    stop_token_ids: set[int] = field(default_factory=set)


@dataclass
class SamplingMetadata:
    """Batched sampling parameters for N rows over a vocabulary of V tokens."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [N] float32; greedy rows hold 1.0 so dividing by it is harmless. None when all greedy.
    temperature: torch.Tensor | None
    # [N] bool, True for greedy rows. Only set when greedy and random rows are mixed.
    greedy_mask: torch.Tensor | None
    # [N] int64, 0 = no top-k; values are clamped to the vocabulary size.
    top_k: torch.Tensor | None
    # Host copy of max(top_k) so torch.topk needs no device read.
    max_top_k: int
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    frequency_penalties: torch.Tensor | None  # [N] float32
    presence_penalties: torch.Tensor | None  # [N] float32
    repetition_penalties: torch.Tensor | None  # [N] float32
    # [N, V] float32 count of each token in each row's output; set with any penalty.
    output_token_counts: torch.Tensor | None
    # [N, V] bool, token appears in the prompt; set with the repetition penalty.
    prompt_token_mask: torch.Tensor | None
    # [2, M] int64 (row, token) pairs to rule out: stop tokens of rows still below
    # min_tokens, and the tokens that would complete one of a row's bad words.
    banned_token_index: torch.Tensor | None
    # Row index -> the row's own generator (seeded, non-greedy rows only).
    generators: dict[int, torch.Generator]
    # Top logprobs to return: the max over rows that asked; None when no row asked.
    max_num_logprobs: int | None
    # [N, V] bool from allowed_token_ids (rows without them all True); None when unused.
    allowed_token_mask: torch.Tensor | None = None
    # logit_bias of every row that has one: [2, M] int64 (row, token) and [M] float32 biases.
    logit_bias_index: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        columns: BatchColumns | None = None,
    ) -> SamplingMetadata:
        """`columns`: the rows' knobs, gathered from the runner's SamplingColumns; without
        them they are read from each row's parameters."""
        if columns is None:
            seeded = [row.generator is not None for row in rows]
            columns = BatchColumns.of([row.params for row in rows], seeded)
        greedy = columns.greedy
        all_greedy = bool(greedy.all())
        all_random = not greedy.any()
        # The features most batches do not use (penalties, min_tokens, bad words,
        # logit_bias, allowed_token_ids): without any, their passes are skipped.
        extras = bool(columns.extras.any())
        params = [row.params for row in rows] if extras else []
        floats = _float_columns(columns, params, all_greedy, device)
        if all_greedy:
            ks = np.zeros(0, dtype=np.int64)
        else:
            ks = np.where(greedy, 0, np.minimum(columns.top_k, vocab_size))
        max_top_k = int(ks.max(initial=0))
        output_counts, prompt_mask = (
            _penalty_tensors(rows, vocab_size, device) if extras else (None, None)
        )
        pairs = _banned_pairs(rows, vocab_size) if extras else []
        wanted = columns.logprobs
        max_logprobs = int(wanted.max(initial=NO_LOGPROBS))
        bias_index, bias_values = (
            _logit_bias(params, vocab_size, device) if extras else (None, None)
        )
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=floats.get("temperature"),
            greedy_mask=None
            if all_greedy or all_random
            else _to_device(greedy.tolist(), torch.bool, device),
            top_k=_to_device(ks.tolist(), torch.int64, device) if max_top_k > 0 else None,
            max_top_k=max_top_k,
            top_p=floats.get("top_p"),
            min_p=floats.get("min_p"),
            frequency_penalties=floats.get("frequency"),
            presence_penalties=floats.get("presence"),
            repetition_penalties=floats.get("repetition"),
            output_token_counts=output_counts,
            prompt_token_mask=prompt_mask,
            banned_token_index=_to_device(
                [list(c) for c in zip(*pairs, strict=True)], torch.int64, device
            )
            if pairs
            else None,  # fmt: skip
            allowed_token_mask=_allowed_token_mask(params, vocab_size, device) if extras else None,
            logit_bias_index=bias_index,
            logit_bias_values=bias_values,
            # Only seeded rows have a generator of their own: few, so few are looked at.
            generators={
                i: generator
                for i in np.flatnonzero(columns.seeded).tolist()
                if (generator := rows[i].generator) is not None
            },
            max_num_logprobs=None if max_logprobs == NO_LOGPROBS else max_logprobs,
        )


def _float_columns(
    columns: BatchColumns,
    params: Sequence[SamplingParams],
    all_greedy: bool,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The per-row float knobs some row uses, as [N] tensors that cross in one transfer
    (`params`: every row's, given when some row may use penalties; else empty)."""
    columns_used: dict[str, np.ndarray | list[float]] = {}
    if not all_greedy:
        # Greedy rows hold 1.0, so dividing by it is harmless.
        columns_used["temperature"] = np.where(columns.greedy, 1.0, columns.temperature)
        if (columns.top_p < 1.0).any():
            columns_used["top_p"] = columns.top_p
        if (columns.min_p > 0.0).any():
            columns_used["min_p"] = columns.min_p
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        columns_used["frequency"] = [p.frequency_penalty for p in params]
        columns_used["presence"] = [p.presence_penalty for p in params]
    if any(p.repetition_penalty != 1.0 for p in params):
        columns_used["repetition"] = [p.repetition_penalty for p in params]
    if not columns_used:
        return {}
    packed = np.asarray(list(columns_used.values()), dtype=np.float32)
    tensor = torch.from_numpy(packed)
    if device.type == "cuda":
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    else:
        tensor = tensor.to(device)
    return dict(zip(columns_used, tensor.unbind(0), strict=True))


def _penalty_tensors(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[N, V] counts of each row's output tokens (with any penalty) and a [N, V] mask of its
    prompt tokens (with the repetition penalty); rows without penalties stay zero."""
    penalized = [r.params.needs_penalties for r in rows]
    if not any(penalized):
        return None, None
    num_cells = len(rows) * vocab_size
    outputs = [r.output_token_ids if on else [] for r, on in zip(rows, penalized, strict=True)]
    index = _flat_token_index(outputs, vocab_size, device)
    counts = torch.zeros(num_cells, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    prompt_mask = None
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        prompts = [r.prompt_token_ids if on else [] for r, on in zip(rows, penalized, strict=True)]
        index = _flat_token_index(prompts, vocab_size, device)
        mask = torch.zeros(num_cells, dtype=torch.bool, device=device)
        mask.scatter_(0, index, True)
        prompt_mask = mask.view(len(rows), vocab_size)
    return counts.view(len(rows), vocab_size), prompt_mask


def _banned_pairs(rows: Sequence[SamplingRow], vocab_size: int) -> list[tuple[int, int]]:
    """(row, token) pairs no row may sample now: its stop tokens while it is below
    min_tokens, and the last token of each bad word whose other tokens end its output."""
    pairs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) < params.min_tokens:
            pairs.extend((i, t) for t in sorted(row.stop_token_ids) if t < vocab_size)
        output = row.output_token_ids
        for word in params.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > len(output) or word[-1] >= vocab_size:
                continue
            if prefix == 0 or output[-prefix:] == word[:-1]:
                pairs.append((i, word[-1]))
    return pairs


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sparse (row, token) -> bias for the rows with a logit_bias; (None, None) when none."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab_size:
                rows.append(i)
                tokens.append(token)
                values.append(bias)
    if not rows:
        return None, None
    return (
        _to_device([rows, tokens], torch.int64, device),
        _to_device(values, torch.float32, device),
    )


def _allowed_token_mask(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[N, V] True where a row may sample; None when no row restricts its tokens."""
    if all(p.allowed_token_ids is None for p in params):
        return None
    mask = np.ones((len(params), vocab_size), dtype=np.bool_)
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            mask[i] = False
            ids = np.asarray(p.allowed_token_ids, dtype=np.int64)
            mask[i, ids[ids < vocab_size]] = True
    tensor = torch.from_numpy(mask)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _to_device(data: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host->device copy; from pinned memory and asynchronous on CUDA."""
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


def _flat_token_index(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """row * vocab_size + token for every token of every row: an index into a flattened
    [N, V] tensor. Built with numpy, which turns long token lists into arrays far faster
    than torch.tensor does."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    tokens = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    rows = np.repeat(np.arange(len(seqs), dtype=np.int64), lengths)
    # An id outside the logits (a padded or foreign vocabulary) has nothing to penalise.
    valid = (tokens >= 0) & (tokens < vocab_size)
    flat = torch.from_numpy(rows[valid] * vocab_size + tokens[valid])
    if device.type == "cuda":
        return flat.pin_memory().to(device, non_blocking=True)
    return flat.to(device)
