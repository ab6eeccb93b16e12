"""The runner's speculative decoding glue: which proposer a config asks for, the draft
probabilities a verification step needs, and the proposals that follow a collected step."""

from __future__ import annotations

import numpy as np
import torch

from asyncserve.config import EngineConfig
from asyncserve.core.step import StepResult
from asyncserve.spec_decode.config import can_speculate
from asyncserve.spec_decode.draft_proposer import DraftProposer
from asyncserve.spec_decode.eagle_proposer import EagleProposer
from asyncserve.spec_decode.ngram_proposer import NgramProposer
from asyncserve.worker.input_batch import CachedRequestState

Proposer = NgramProposer | DraftProposer | EagleProposer


def make_proposer(
    config: EngineConfig,
    model: torch.nn.Module,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Proposer | None:
    """The proposer of `config.speculative` (None without speculative decoding)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if spec.method in ("eagle", "eagle3"):
        return EagleProposer(spec, model, dtype, device, config.cache.block_size)
    return DraftProposer(spec, vocab_size, dtype, device, config.cache.block_size)


def draft_probs(
    proposer: Proposer | None, request_ids: list[str], spec: list[list[int]]
) -> list[torch.Tensor | None] | None:
    """The draft distributions behind each request's proposals (a model proposer keeps
    them for rejection sampling; n-gram proposals have none)."""
    if not isinstance(proposer, DraftProposer | EagleProposer):
        return None
    return [proposer.draft_probs(rid, len(s)) for rid, s in zip(request_ids, spec, strict=True)]


def propose(
    proposer: Proposer, states: list[CachedRequestState], result: StepResult, max_model_len: int
) -> None:
    """Proposals to follow each sampled request's tokens, verified by its next step."""
    states = [s for s in states if can_speculate(s.sampling_params, len(s.output_token_ids))]
    if isinstance(proposer, DraftProposer | EagleProposer):
        # Its proposals write K/V at the next k - 1 positions, which must exist.
        limit = max_model_len - proposer.k
        states = [state for state in states if state.num_tokens <= limit]
        result.draft_token_ids.update(proposer.propose(states))
        return
    for state in states:
        tokens = np.asarray(state.prompt_token_ids + state.output_token_ids, dtype=np.int64)
        drafts = proposer.propose(tokens)
        if drafts:
            result.draft_token_ids[state.request_id] = drafts
