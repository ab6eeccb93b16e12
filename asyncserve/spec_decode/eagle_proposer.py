"""EAGLE proposer: an EAGLE-1 or EAGLE-3 head proposes k tokens from the target's hidden
states (its output for EAGLE-1; for EAGLE-3, three layers' inputs joined by the head's
`fc`, see eagle3_head.py).

The head keeps its own one-layer paged KV cache, read through the target's block tables
(block b of a request holds the same positions in both pools). Head position p is fed the
token at p + 1 and the target's hidden state at p, so each target forward's hidden states
are recorded (`record`) until the tokens after them are known. A proposal round catches the
head up on the positions recorded since its last round (whose last output gives the first
proposal), then runs k - 1 one-token steps, each fed the proposal before it and the head's
own output hidden state (replayed CUDA graphs on the GPU, see model_proposer.py). Those
steps write K/V into the k lookahead slots the scheduler holds; the next round overwrites
them from the target's hidden states.

Proposals are sampled as the draft model's are (see draft_proposer.py), keeping q for the
rejection sampler. Positions the target did not compute (a prefix-cache hit) give the head
no hidden states: it starts at the first computed one, reading whatever K/V the cached
blocks hold before it, which can only lower acceptance.
"""

from __future__ import annotations

import logging

import torch

from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.spec_decode.config import SpeculativeConfig
from asyncserve.spec_decode.draft_proposer import _block_tables, _choose, proposal_sampling
from asyncserve.spec_decode.eagle3_head import Eagle3Head, load_eagle3_head
from asyncserve.spec_decode.eagle_head import EagleHead, load_eagle_head
from asyncserve.spec_decode.model_proposer import ModelProposer
from asyncserve.worker.input_batch import CachedRequestState

logger = logging.getLogger(__name__)


class _Pending:
    """Target hidden states recorded for one request from position `start` on."""

    def __init__(self, state: CachedRequestState, start: int) -> None:
        self.state = state
        self.start = start
        self.rows: list[torch.Tensor] = []
        self.end = start

    def add(self, start: int, rows: torch.Tensor) -> None:
        if start < self.end:
            # Positions computed again (after rejected proposals): keep the new ones.
            if start > self.start:
                self.rows = [torch.cat(self.rows)[: start - self.start]]
            else:
                self.rows, self.start = [], start
            self.end = start
        self.rows.append(rows)
        self.end += rows.shape[0]

    def take(self, start: int, end: int) -> torch.Tensor:
        return torch.cat(self.rows)[start - self.start : end - self.start]


class EagleProposer(ModelProposer):
    def __init__(
        self,
        spec: SpeculativeConfig,
        target: torch.nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
    ) -> None:
        super().__init__()
        assert spec.model is not None
        if not isinstance(target, LlamaForCausalLM):
            raise ValueError(
                f"speculative_config: method {spec.method!r} needs a Llama-family target, got "
                f"{type(target).__name__}"
            )
        self.target = target
        self.head: EagleHead | Eagle3Head
        self.embed_tokens: torch.nn.Module = target.model.embed_tokens
        self.compute_logits = target.compute_logits
        self.head = _load_head(spec, target, dtype, device)
        if isinstance(self.head, Eagle3Head):
            # The target keeps the residual stream entering these layers from now on.
            target.model.aux_hidden_state_layers = frozenset(self.head.aux_layers)
            if self.head.embed_tokens is not None:
                self.embed_tokens = self.head.embed_tokens
            self.compute_logits = self.head.compute_logits
        self.arch = self.head.arch
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.k = spec.num_speculative_tokens
        self.vocab_size = target.config.vocab_size
        # Request id -> the target hidden states recorded for it.
        self._pending: dict[str, _Pending] = {}
        self._hidden_in: torch.Tensor | None = None

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._pending.pop(request_id, None)

    def record(
        self,
        states: dict[str, CachedRequestState],
        request_ids: list[str],
        starts: list[int],
        counts: list[int],
        hidden: torch.Tensor,
    ) -> None:
        """Keep the head's input hidden states [T, H] of one target forward (`hidden`: its
        output; rows in request order)."""
        hidden = self.head.target_states(self.target, hidden)
        offset = 0
        for rid, start, count in zip(request_ids, starts, counts, strict=True):
            rows = hidden[offset : offset + count]
            offset += count
            state = states[rid]
            params = state.sampling_params
            if params.needs_output_tokens or params.logprobs is not None:
                continue  # never speculates (see can_speculate)
            pending = self._pending.get(rid)
            if pending is None or pending.state is not state or start > pending.end:
                pending = self._pending[rid] = _Pending(state, start)
            pending.add(start, rows)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """k proposals for each request (all of its tokens known) with hidden states."""
        chosen: list[CachedRequestState] = []
        starts: list[int] = []
        hidden_rows: list[torch.Tensor] = []
        for state in states:
            pending = self._pending.get(state.request_id)
            last = state.num_tokens - 1  # head positions [start, last) have their token
            if pending is None or pending.state is not state or pending.end < last:
                continue
            seen = self._progress.get(state.request_id)
            start = seen[1] if seen is not None and seen[0] is state else 0
            start = min(max(start, pending.start), last - 1)
            if start < pending.start:
                continue
            chosen.append(state)
            starts.append(start)
            hidden_rows.append(pending.take(start, last))
        if not chosen:
            return {}
        ends = [state.num_tokens - 1 for state in chosen]
        tables = _block_tables(chosen, self.device)
        meta = proposal_sampling(chosen, self.vocab_size, self.device)

        token_ids: list[int] = []
        for state, start, end in zip(chosen, starts, ends, strict=True):
            token_ids.extend(state.token_slice(start + 1, end + 1))
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        logits, hidden = self._forward(ids, torch.cat(hidden_rows), starts, ends, tables)
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(self.k):
            if step:
                positions = [end + step - 1 for end in ends]
                pos_t, step_meta, graphs = self._one_token_inputs(positions, tables)
                if graphs is not None:
                    assert self._hidden_in is not None
                    self._hidden_in[: len(chosen)].copy_(hidden)
                    logits, hidden = graphs.replay(drafts[-1], pos_t, step_meta)
                else:
                    logits, hidden = self._head_step(drafts[-1], hidden, pos_t, step_meta)
            token, q = _choose(logits, meta)
            drafts.append(token)
            if q is not None:
                probs.append(q)
        for state, end in zip(chosen, ends, strict=True):
            self._progress[state.request_id] = (state, end)
            # The next target forward starts again at `end`: nothing recorded is needed.
            self._pending.pop(state.request_id, None)
        if probs:
            stacked = torch.stack(probs, dim=1)  # [B, k, V]
            for i, state in enumerate(chosen):
                if not state.sampling_params.greedy:
                    self._probs[state.request_id] = stacked[i]
        proposed = torch.stack(drafts, dim=1).tolist()
        return {state.request_id: proposed[i] for i, state in enumerate(chosen)}

    def _forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        starts: list[int],
        ends: list[int],
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over positions [start, end) of each request; returns, at each
        request's last position, the logits and the head's output fed back."""
        pos_t, meta, last = self._layout(starts, ends, block_tables)
        embeds = self.embed_tokens(token_ids)
        out, fed_back = self.head(embeds, hidden, pos_t, self.kv_caches, meta)
        return self.compute_logits(out[last]), fed_back[last]

    def _head_step(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step: (logits, the head's output fed back), a row per request."""
        out, fed_back = self.head(
            self.embed_tokens(token_ids), hidden, positions, self.kv_caches, meta
        )
        return self.compute_logits(out), fed_back

    def use_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        super().use_cuda_graphs(max_batch, max_model_len)
        assert self.graphs is not None
        # The hidden states fed back are the graphs' second input, in a buffer of their own.
        self._hidden_in = torch.zeros(
            self.graphs.max_batch, self.arch.hidden_size, dtype=self.dtype, device=self.device
        )

    def _decode_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        assert self._hidden_in is not None
        return self._head_step(token_ids, self._hidden_in[: len(token_ids)], positions, meta)


def _load_head(
    spec: SpeculativeConfig, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> EagleHead | Eagle3Head:
    """The head `spec.model` names. A head folder is outside input: whatever breaks while
    reading it (bad JSON values, corrupt or mismatched tensors) is one line naming it."""
    assert spec.model is not None
    load = load_eagle3_head if spec.method == "eagle3" else load_eagle_head
    try:
        return load(spec.model, target.config, dtype, device)
    except ValueError as exc:
        if str(exc).startswith("speculative_config"):
            raise
        reason = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # corrupt files raise many types (SafetensorError, pickle, ...)
        logger.debug("loading the head %s failed", spec.model, exc_info=True)
        reason = f"{type(exc).__name__}: {exc}"
    what = "EAGLE-3 head" if spec.method == "eagle3" else "EAGLE head"
    raise ValueError(f"speculative_config: cannot load the {what} {spec.model!r}: {reason}")
