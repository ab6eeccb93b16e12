"""Draft-model proposer: a small model with the target's vocabulary proposes k tokens.

The draft keeps its own paged KV cache with as many blocks as the target's and reads the
same block tables: block b of a request holds the same positions in both pools. Each
proposal round first catches the draft up on the request's tokens it has not seen (the
whole prompt the first time, then the tokens accepted since), which yields the first
proposal, then runs k - 1 one-token steps (replayed CUDA graphs on the GPU, see
model_proposer.py). The scheduler allocates k lookahead slots per request so those steps
have somewhere to write.

Proposals are sampled with the request's own temperature / top-k / top-p / min_p (greedy
rows take the argmax); their distributions are kept for the rejection sampler, which needs
q to keep the target distribution exact. Prefix-cache hits are not used by the draft: it
computes a new request's prompt itself (its K/V in a shared block are the same values).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncserve.config import ModelConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.loader import load_model
from asyncserve.spec_decode.config import SpeculativeConfig
from asyncserve.spec_decode.model_proposer import ModelProposer
from asyncserve.spec_decode.rejection_sampler import sample_from, target_probs
from asyncserve.worker.input_batch import CachedRequestState
from asyncserve.worker.sampler import process_logits
from asyncserve.worker.sampling_metadata import SamplingMetadata, SamplingRow

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DraftProposer(ModelProposer):
    def __init__(
        self,
        spec: SpeculativeConfig,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
    ) -> None:
        super().__init__()
        assert spec.model is not None
        loaded = load_model(ModelConfig(model=spec.model, dtype=_DTYPE_NAMES[dtype]), device)
        if loaded.arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({loaded.arch.vocab_size} "
                f"tokens) differs from the target's ({target_vocab_size})"
            )
        self.model = loaded.model
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.device = device
        self.block_size = block_size
        self.k = spec.num_speculative_tokens
        self.vocab_size = target_vocab_size

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """k proposals for each request (all of its tokens known)."""
        if not states:
            return {}
        starts: list[int] = []
        for state in states:
            seen = self._progress.get(state.request_id)
            start = seen[1] if seen is not None and seen[0] is state else 0
            # At least the last token goes in: its logits give the first proposal.
            starts.append(min(start, state.num_tokens - 1))
        ends = [state.num_tokens for state in states]
        tables = _block_tables(states, self.device)
        meta = proposal_sampling(states, self.vocab_size, self.device)

        # Catch up on the unseen tokens; the last one's logits give the first proposal.
        token_ids: list[int] = []
        for state, start, end in zip(states, starts, ends, strict=True):
            token_ids.extend(state.token_slice(start, end))
        logits = self._forward(token_ids, starts, ends, tables)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(self.k):
            if step:
                positions = [end + step - 1 for end in ends]
                pos_t, step_meta, graphs = self._one_token_inputs(positions, tables)
                if graphs is not None:
                    (logits,) = graphs.replay(drafts[-1], pos_t, step_meta)
                else:
                    (logits,) = self._decode_forward(drafts[-1], pos_t, step_meta)
            token, q = _choose(logits, meta)
            drafts.append(token)
            if q is not None:
                probs.append(q)
        for state, end in zip(states, ends, strict=True):
            self._progress[state.request_id] = (state, end)
        if probs:
            stacked = torch.stack(probs, dim=1)  # [B, k, V]
            for i, state in enumerate(states):
                if not state.sampling_params.greedy:
                    self._probs[state.request_id] = stacked[i]
        ids = torch.stack(drafts, dim=1).tolist()
        return {state.request_id: ids[i] for i, state in enumerate(states)}

    def _decode_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        hidden = self.model(token_ids, positions, self.kv_caches, meta)
        return (self.model.compute_logits(hidden),)

    def _forward(
        self,
        token_ids: list[int],
        starts: list[int],
        ends: list[int],
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """One draft forward over positions [start, end) of each request; returns the
        logits of each request's last position."""
        pos_t, meta, last = self._layout(starts, ends, block_tables)
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        hidden = self.model(ids, pos_t, self.kv_caches, meta)
        return self.model.compute_logits(hidden[last])


def _block_tables(states: list[CachedRequestState], device: torch.device) -> torch.Tensor:
    width = max(len(s.block_ids) for s in states)
    table = np.zeros((len(states), width), dtype=np.int32)
    for i, state in enumerate(states):
        table[i, : len(state.block_ids)] = state.block_ids
    return torch.from_numpy(table).to(device)


def proposal_sampling(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling settings of the requests' proposals: their own, seeded by their progress."""
    rows = [
        SamplingRow(
            params=s.sampling_params,
            prompt_token_ids=s.prompt_token_ids,
            output_token_ids=s.output_token_ids,
            generator=_generator(s, device),
        )
        for s in states
    ]
    return SamplingMetadata.build(rows, vocab_size, device)


def _generator(state: CachedRequestState, device: torch.device) -> torch.Generator | None:
    """Seeded requests draw their proposals from a generator tied to their progress."""
    seed = state.sampling_params.seed
    if seed is None or state.sampling_params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 7919 + state.num_tokens) & ((1 << 63) - 1))
    return generator


def _choose(
    logits: torch.Tensor, meta: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's proposal and, unless every row is greedy, the distributions they were
    drawn from (processed as the target's)."""
    logits = process_logits(logits.float(), meta)
    greedy = None if meta.all_random else logits.argmax(dim=-1)
    if meta.all_greedy:
        assert greedy is not None
        return greedy, None
    # A row left with no token (an EAGLE-3 draft vocabulary disjoint from the request's
    # allowed tokens) proposes from the uniform distribution: a valid q, always rejected.
    logits = logits.masked_fill(torch.isneginf(logits).all(dim=-1, keepdim=True), 0.0)
    q = target_probs(logits, meta)
    token = sample_from(q, meta)
    if greedy is not None:
        assert meta.greedy_mask is not None
        token = torch.where(meta.greedy_mask, greedy, token)
    return token, q
