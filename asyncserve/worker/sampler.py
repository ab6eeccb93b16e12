"""Batched logits processing and sampling on the device (the same code on CPU and CUDA).

Order as vLLM v1: raw logprobs -> logit_bias -> allowed-token mask -> min_tokens and bad words -> penalties -> greedy
argmax -> temperature -> min_p -> top-k -> top-p -> sample. Nothing reads a device value back
to the host, and nothing loops over the vocabulary; the only Python loop is over seeded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncserve.worker.logprobs import gather_logprobs
from asyncserve.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")
# Keeps exponential draws away from 0, where probs / q would give inf or nan.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64, on the device
    # [N, 1 + max_num_logprobs]: column 0 is the sampled token, then the top-k by raw logprob.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    # [N] int64: 1-based rank of the sampled token by raw logprob.
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] -> one token per row. The caller's tensor is never modified."""
        if logits.shape != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the sampling metadata "
                f"({meta.num_rows}, {meta.vocab_size})"
            )
        logits = logits.float()
        # Logprobs are reported on the model's logits, before any processing (vLLM's default).
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = process_logits(logits, meta)
        sampled = sample(logits, meta)
        if raw_logprobs is None or meta.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, vals, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=vals, sampled_ranks=ranks
        )


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The steps that can change the greedy choice. Returns a new tensor when any applies."""
    if meta.logit_bias_index is not None:
        assert meta.logit_bias_values is not None
        rows, tokens = meta.logit_bias_index
        logits = logits.index_put((rows, tokens), meta.logit_bias_values, accumulate=True)
    if meta.allowed_token_mask is not None:
        logits = logits.masked_fill(~meta.allowed_token_mask, _NEG_INF)
    if meta.banned_token_index is not None:
        rows, tokens = meta.banned_token_index
        logits = logits.index_put((rows, tokens), logits.new_tensor(_NEG_INF))
    if not meta.no_penalties:
        logits = apply_penalties(logits, meta)
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI) penalties; out of place.

    Repetition applies to tokens in the prompt or the output: positive logits are divided
    by the penalty, negative ones multiplied. Then logits -= freq * count + pres * (count > 0)
    over output tokens.
    """
    counts = meta.output_token_counts
    if counts is None:
        return logits
    in_output = counts > 0
    rep = meta.repetition_penalties
    if rep is not None:
        seen = in_output if meta.prompt_token_mask is None else in_output | meta.prompt_token_mask
        rep = rep.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq, pres = meta.frequency_penalties, meta.presence_penalties
    if freq is not None and pres is not None:
        logits = logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * in_output
    return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the GPU the two-pass kernel for a few rows (torch's took
    36 us for one row of a 128k vocabulary)."""
    if logits.is_cuda:
        from asyncserve.kernels.argmax import argmax

        return argmax(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Greedy rows take the argmax, the others a random draw; [N] int64."""
    greedy = None if meta.all_random else _argmax(logits)
    if meta.all_greedy:
        assert greedy is not None
        return greedy
    assert meta.temperature is not None
    # Division makes a fresh tensor, which the steps below may change in place.
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        apply_min_p_(logits, meta.min_p)
    apply_top_k_top_p_(logits, meta.top_k, meta.max_top_k, meta.top_p)
    random = exponential_race_(logits.softmax(dim=-1), meta.generators)
    if greedy is None:
        return random
    assert meta.greedy_mask is not None
    return torch.where(meta.greedy_mask, greedy, random)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p_(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """In place: keep each row's top_k tokens (0 = all), then the smallest set of those whose
    probability sums to at least top_p (always at least one token)."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # Top-k alone: torch.topk to the largest k of the batch is cheaper than a full sort.
        disabled = top_k == 0
        kth = logits.topk(max_top_k, dim=-1).values
        kth = kth.gather(1, (top_k - 1).clamp_(min=0).unsqueeze(1))
        kth.masked_fill_(disabled.unsqueeze(1), _NEG_INF)
        return logits.masked_fill_(logits < kth, _NEG_INF)

    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k == 0, vocab_size, top_k)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Ascending order: a token goes when the tokens above it already reach top_p.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def exponential_race_(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row as argmax(probs / q), q ~ Exponential(1); changes probs.

    This equals sampling from probs, with no host sync. Seeded rows draw q from their own
    generator, so their tokens do not depend on the batch or their row in it.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    q.clamp_(min=_TINY)
    return probs.div_(q).argmax(dim=-1)
