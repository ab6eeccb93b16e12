"""Turns the runner's per-request state and a StepPlan into the step's input tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncserve.core.request import token_slice
from asyncserve.core.step import StepPlan
from asyncserve.lora.request import LoRARequest
from asyncserve.models.attention import AttentionMetadata
from asyncserve.multimodal.inputs import MultiModalFeatures
from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.block_table import BlockTable
from asyncserve.worker.sampling_metadata import SamplingRow

# Stands for a token sampled by a step still in flight (see model_runner.LaunchedStep).
PLACEHOLDER_TOKEN = -1


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: set[int]
    # While its last output token is a placeholder: the device tensor of sampled ids that
    # holds it, and the row.
    in_flight: tuple[torch.Tensor, int] | None = None
    lora_request: LoRARequest | None = None
    mm_features: MultiModalFeatures | None = None
    # The request's sampling row, made once: it holds the token lists themselves, which
    # change in place (a seeded row's generator is set on each of its sampling steps).
    sampling_row: SamplingRow = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow(
            self.sampling_params,
            self.prompt_token_ids,
            self.output_token_ids,
            None,
            self.stop_token_ids,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Batch order of the requests in this step.
    request_ids: list[str]
    # Start position of each request's chunk and its scheduled count.
    starts: list[int]
    counts: list[int]
    # Requests whose chunk reaches their last known token: they sample this step.
    sample_request_ids: list[str]
    # Rows in the flattened tokens whose hidden states are scored: one per sampled request,
    # or k + 1 for a request verifying k proposals (speculative decoding).
    logits_indices: torch.Tensor  # [num_logits] int64
    # Input tokens that are placeholders: their rows in input_ids, and the rows of
    # placeholder_source (the last step's sampled ids) that hold them. None when none.
    placeholder_index: torch.Tensor | None = None
    placeholder_rows: torch.Tensor | None = None
    placeholder_source: torch.Tensor | None = None
    # Per sampled request, the proposals it verifies (empty for most); None when none does.
    spec_token_ids: list[list[int]] | None = None


def build_step_inputs(
    plan: StepPlan,
    states: dict[str, CachedRequestState],
    block_size: int,
    staging: HostStaging,
    block_table: BlockTable | None = None,
) -> StepInputs:
    """The step's tensors. `block_table`: the runner's table kept between steps (holding
    every scheduled request); without it one is built from the states' block ids."""
    scheduled = plan.num_scheduled_tokens
    request_ids = list(scheduled)
    counts = list(scheduled.values())
    total = sum(counts)
    num_reqs = len(request_ids)

    # This loop runs for every request every step: plain ints and list appends only.
    token_ids: list[int] = []
    starts: list[int] = []
    sample_request_ids: list[str] = []
    logits_indices: list[int] = []
    placeholder_index: list[int] = []
    placeholder_rows: list[int] = []
    placeholder_source: torch.Tensor | None = None
    all_spec = plan.scheduled_spec_tokens
    spec_token_ids: list[list[int]] = []
    no_spec: list[int] = []
    cu = 0  # tokens of the requests before this one
    for rid, count in scheduled.items():
        state = states[rid]
        start = state.num_computed_tokens
        spec = all_spec.get(rid, []) if all_spec else no_spec
        # Proposals follow the last known token; they are not in the state's tokens.
        known_end = start + count - len(spec)
        starts.append(start)
        prompt = state.prompt_token_ids
        output = state.output_token_ids
        num_prompt = len(prompt)
        if count == 1 and not spec:
            # A decode's one token, read without a slice.
            token_ids.append(output[start - num_prompt] if start >= num_prompt else prompt[start])
        else:
            token_ids.extend(token_slice(prompt, output, start, known_end))
            token_ids.extend(spec)
        cu += count
        if known_end >= num_prompt + len(output):
            sample_request_ids.append(rid)
            last = cu - 1
            if spec:
                logits_indices.extend(range(last - len(spec), last + 1))
            else:
                logits_indices.append(last)
            spec_token_ids.append(spec)
            if state.in_flight is not None:
                # The last output token is still being sampled by the step before.
                source, row = state.in_flight
                if placeholder_source is None:
                    placeholder_source = source
                elif source is not placeholder_source:
                    raise RuntimeError("placeholder tokens from two different steps")
                placeholder_index.append(last - len(spec))
                placeholder_rows.append(row)

    counts_np = np.asarray(counts, dtype=np.int64)
    starts_np = np.asarray(starts, dtype=np.int64)
    cu_seqlens = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(counts_np, out=cu_seqlens[1:])
    seq_lens = (starts_np + counts_np).astype(np.int32)
    if block_table is None:
        block_table = BlockTable.of((rid, states[rid].block_ids) for rid in request_ids)
    block_tables = block_table.gather(request_ids)
    max_blocks = block_tables.shape[1]

    # Positions and slots for every token, vectorised: token t of request i sits at
    # starts[i] + (t - cu[i]).
    req_index = np.repeat(np.arange(num_reqs), counts_np)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1], counts_np)
    positions += np.repeat(starts_np, counts_np)
    block_of_token = block_tables[req_index, positions // block_size].astype(np.int64)
    slot_mapping = block_of_token * block_size + positions % block_size

    # Every integer array crosses to the device in one copy, the int32 ones as int32.
    parts: list[np.ndarray] = [
        np.asarray(token_ids, dtype=np.int64),
        positions,
        slot_mapping,
        np.asarray(logits_indices, dtype=np.int64),
        cu_seqlens,
        seq_lens,
        block_tables.ravel().astype(np.int32, copy=False),
        np.asarray(placeholder_index, dtype=np.int64),
        np.asarray(placeholder_rows, dtype=np.int64),
    ]
    # A decode step's sequences longest first: attention's programs take them in that order.
    ordered = num_reqs > 1 and int(counts_np.max()) == 1
    if ordered:
        parts.append(np.argsort(-seq_lens, kind="stable").astype(np.int32))
    staged = staging.to_device(parts)
    order_t = staged.pop() if ordered else None
    ids_t, positions_t, slots_t, logits_t, cu_t, lens_t, tables_t, ph_index_t, ph_rows_t = staged
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        cu_seqlens_q=cu_t,
        seq_lens=lens_t,
        block_tables=tables_t.view(num_reqs, max_blocks),
        max_seqlen_q=max(counts) if counts else 0,
        max_seqlen_k=int(seq_lens.max()) if num_reqs else 0,
        seq_order=order_t,
    )
    return StepInputs(
        input_ids=ids_t,
        positions=positions_t,
        meta=meta,
        request_ids=request_ids,
        starts=starts,
        counts=counts,
        sample_request_ids=sample_request_ids,
        logits_indices=logits_t,
        placeholder_index=ph_index_t if placeholder_index else None,
        placeholder_rows=ph_rows_t if placeholder_index else None,
        placeholder_source=placeholder_source,
        spec_token_ids=spec_token_ids if all_spec else None,
    )


class HostStaging:
    """A reusable host buffer (pinned on CUDA) that carries a step's arrays in one copy.

    Each array arrives as int64, or as int32 when it is int32 on the host (cu_seqlens,
    seq_lens, block tables): the kernels read int32 there, and a cast on the device would be
    a kernel of its own each step. Arrays start at 16-byte offsets of the one buffer: each
    device slice is viewed in its dtype, and is aligned as a tensor of its own would be (a
    Triton kernel compiles a variant per pointer alignment).

    Before the buffer is rewritten, the copy that last read it must have finished: an
    event recorded after each copy is waited on first (it has almost always passed).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.copied: torch.cuda.Event | None = None

    def to_device(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy `parts` over at once; return device tensors, int32 for int32 parts, int64
        for the others (converted on the host)."""
        layout = []  # (byte offset, bytes, dtype) of each part
        total = 0
        for part in parts:
            dtype = np.dtype(np.int32 if part.dtype == np.int32 else np.int64)
            nbytes = len(part) * dtype.itemsize
            layout.append((total, nbytes, dtype))
            total += -(-nbytes // 16) * 16
        if self.copied is not None:
            self.copied.synchronize()
        if self.buffer.numel() < total:
            self.buffer = torch.empty(max(total, 2 * self.buffer.numel()), dtype=torch.uint8)
            if self.pin:
                self.buffer = self.buffer.pin_memory()
        host = self.buffer[:total]
        host_bytes = host.numpy()
        for part, (offset, nbytes, dtype) in zip(parts, layout, strict=True):
            np.copyto(host_bytes[offset : offset + nbytes].view(dtype), part, casting="unsafe")
        if self.device.type == "cpu":
            flat = host.clone()
        else:
            flat = host.to(self.device, non_blocking=self.pin)
            if self.pin:
                self.copied = self.copied or torch.cuda.Event()
                self.copied.record()
        return [
            flat[offset : offset + nbytes].view(_TORCH_DTYPES[dtype.type])
            for offset, nbytes, dtype in layout
        ]


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}
