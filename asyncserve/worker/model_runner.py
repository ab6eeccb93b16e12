"""Model runner: StepPlan -> tensors -> forward -> sampled tokens (StepResult).

It keeps each scheduled request's state (tokens, block table) between steps, so the plan
carries only diffs for running requests. `launch` enqueues a step (forward, sampling, the
copy of the sampled ids to the host) and `collect` waits for it; the async engine runs both
on a worker thread so the event loop never waits on the device.

A sampled token is a placeholder in the request's state from launch to collect. A step
launched in between (async scheduling) takes that token as input straight from the device
tensor the sampler wrote.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.step import GrammarBitmask, StepPlan, StepResult
from asyncserve.lora.slots import LoRASlots
from asyncserve.models.loader import LoadedModel, load_safetensors_weights
from asyncserve.models.multimodal import is_multimodal, uses_mrope
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.pipeline import PipelineStage
from asyncserve.spec_decode.draft_proposer import DraftProposer
from asyncserve.spec_decode.eagle_proposer import EagleProposer
from asyncserve.spec_decode.verify import expand_request_ids, verify
from asyncserve.worker import kv_blocks
from asyncserve.worker.block_table import BlockTable
from asyncserve.worker.cuda_graphs import DecodeGraphs
from asyncserve.worker.encoder_cache import EncoderCache
from asyncserve.worker.grammar_mask import apply_grammar_bitmask, warm_up_grammar_kernel
from asyncserve.worker.input_batch import (
    PLACEHOLDER_TOKEN,
    CachedRequestState,
    HostStaging,
    StepInputs,
    build_step_inputs,
)
from asyncserve.worker.kernel_compiles import WATCH
from asyncserve.worker.kv_pool import (
    allocate_kv_caches,
    determine_num_blocks,
    kv_block_bytes,
    kv_cache_dtype,
)
from asyncserve.worker.logprobs import prompt_logprobs, row_entry
from asyncserve.worker.mm_embeds import (
    StepEmbedder,
    mrope_plain_positions,
    past_image_prompts,
    step_mrope_positions,
)
from asyncserve.worker.plan_state import apply_plan
from asyncserve.worker.prefill_graphs import choose_prefill_graph
from asyncserve.worker.runner_steps import ForwardedStep as ForwardedStep
from asyncserve.worker.runner_steps import LaunchedStep as LaunchedStep
from asyncserve.worker.runner_steps import sampling_rows
from asyncserve.worker.sampler import Sampler, SamplerOutput
from asyncserve.worker.sampling_columns import SamplingColumns
from asyncserve.worker.sampling_metadata import SamplingMetadata
from asyncserve.worker.speculation import Proposer, draft_probs, make_proposer, propose
from asyncserve.worker.target_graphs import capture_step_graphs, choose_graphs, max_graph_batch
from asyncserve.worker.vocab_watch import FullVocabWatch, switch_watch

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        device: torch.device,
        tp: TensorParallel = SINGLE,
        pp: PipelineStage | None = None,
    ) -> None:
        WATCH.disarm()  # this engine's start-up compiles are expected (see allocate_kv_cache)
        self.loaded = loaded
        self.model = loaded.model
        self.arch = loaded.arch
        # Only rank 0 samples; the other ranks take its sampled ids (see _sample).
        self.tp = tp
        # Under pipeline parallelism only the last stage computes logits and samples.
        self.pp = pp
        # The KV pool holds this rank's KV heads (and this stage's layers) only.
        self.kv_arch = dataclasses.replace(
            loaded.arch, num_key_value_heads=tp.kv_heads(loaded.arch.num_key_value_heads)[1]
        )
        if pp is not None:
            layer_types = loaded.arch.layer_types
            self.kv_arch = dataclasses.replace(
                self.kv_arch,
                num_hidden_layers=pp.end - pp.start,
                layer_types=layer_types[pp.start : pp.end] if layer_types else layer_types,
            )
        self.config = config
        self.device = device
        self.dtype = loaded.dtype
        self.kv_cache_dtype = kv_cache_dtype(config.cache.cache_dtype, self.dtype, device)
        self.block_size = config.cache.block_size
        self.vocab_size = loaded.arch.vocab_size
        self.sampler = Sampler()
        self.states: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.prefill_graphs: list[DecodeGraphs] = []
        self.staging = HostStaging(device)
        # Every held request's block ids, kept in step with states (see block_table.py).
        self.block_table = BlockTable()
        # Every held request's sampling knobs, by row (see sampling_columns.py).
        self.sampling_columns = SamplingColumns()
        self.lora: LoRASlots | None = None
        lora = config.lora
        if lora.enable_lora:
            self.lora = LoRASlots(
                self.model,
                lora.max_loras,
                lora.max_lora_rank,
                lora.cpu_capacity,
                max(config.scheduler.max_num_batched_tokens, 512),
                self.dtype,
                device,
            )
        self.max_model_len = 0
        # Image embeddings by hash: room for several steps' worth of image rows.
        self.embedder: StepEmbedder | None = None
        if is_multimodal(self.model):
            rows = max(config.scheduler.max_num_batched_tokens, 8192)
            self.embedder = StepEmbedder(self.model, EncoderCache(rows))  # type: ignore[arg-type]
        self._vocab_watch: FullVocabWatch | None = None
        self.proposer: Proposer | None = make_proposer(
            config, self.model, self.vocab_size, self.dtype, device
        )

    def load_weights_from(self, path: str) -> None:
        """New weights from an HF safetensors directory (e.g. a peer model's, so that both
        run the same weights); called on every rank through collective_rpc."""
        load_safetensors_weights(self.model, Path(path), self.device)

    # ---- KV pool -------------------------------------------------------------------------

    def determine_num_blocks(self, max_model_len: int) -> int:
        """How many KV blocks this device holds (see worker/kv_pool.py); a draft model's
        pool takes its share of the budget (the same number of blocks)."""
        num_blocks = determine_num_blocks(self.model, self.kv_arch, self.config,
                                          self.kv_cache_dtype, self.device,
                                          max_model_len)  # fmt: skip
        if (
            isinstance(self.proposer, DraftProposer | EagleProposer)
            and self.config.cache.num_blocks_override is None
        ):
            own = kv_block_bytes(self.kv_arch, self.block_size, self.kv_cache_dtype)
            num_blocks = max(num_blocks * own // (own + self.proposer.block_bytes()), 1)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.kv_arch, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        graphs = self.device.type == "cuda" and self.config.enable_cuda_graphs
        if isinstance(self.proposer, DraftProposer | EagleProposer):
            self.proposer.allocate_kv_cache(num_blocks)
            if graphs:  # its one-token proposal steps replay graphs of their own
                self.proposer.use_cuda_graphs(max_graph_batch(self.config), max_model_len)
        if graphs:
            capture_step_graphs(self, max_model_len)
        if self.device.type == "cuda":
            warm_up_grammar_kernel(self.device)
            WATCH.arm()  # start-up compiled what steps need: later compiles are warnings

    def release(self) -> None:
        """Free the device memory this runner holds (weights, KV cache, CUDA graphs, the
        proposer): its engine is closed, and a later engine in this process (another LLM)
        must find the memory free even while the closed one is still referenced."""
        self.decode_graphs = self.verify_graphs = None
        self.prefill_graphs = []
        if self.embedder is not None:
            self.embedder.graphs = None
        self.kv_caches = []
        self.proposer = None
        self.lora = None
        self.states.clear()
        # In place, so every holder of the module (the engine's LoadedModel) lets go too.
        self.model.to("meta")
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def watch_full_vocab(self, on: bool) -> int:
        """Start or stop counting this rank's full-vocabulary-wide tensors; the count so far."""
        self._vocab_watch, count = switch_watch(self._vocab_watch, on, self.vocab_size)
        return count

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks of this rank's heads, on the CPU (see worker/kv_blocks.py)."""
        return kv_blocks.read_blocks(self.kv_caches, block_ids)

    def read_kv_blocks_on_device(self, block_ids: list[int]) -> tuple[torch.Tensor, Any]:
        """Whole blocks left on the pool's device, and the CUDA event they are ready at
        (None on the CPU): a KV group sends them from there (disagg/kv_group.py)."""
        return kv_blocks.read_blocks_on_device(self.kv_caches, block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> str | None:
        """Blocks carrying every KV head: this rank writes its own; None or why they do not fit."""
        total = self.arch.num_key_value_heads
        return kv_blocks.write_rank_blocks(self.kv_caches, block_ids, data,
                                           self.tp.kv_heads(total), total)  # fmt: skip

    # ---- one step ------------------------------------------------------------------------

    def launch_forward(
        self, plan: StepPlan, on_launched: Callable[[], object] | None = None
    ) -> ForwardedStep:
        """Apply the plan, build the inputs and enqueue the forward pass.

        `on_launched` is called once, as soon as the forward pass is enqueued (or the step
        ends without one), so the caller can hold its own Python work until then: with the
        GIL shared, work on another thread would otherwise delay the launch.
        """
        signalled = False

        def launched() -> None:
            nonlocal signalled
            if on_launched is not None and not signalled:
                signalled = True
                on_launched()

        try:
            return self._forward(plan, launched)
        finally:
            launched()

    @torch.inference_mode()
    def _forward(self, plan: StepPlan, launched: Callable[[], None]) -> ForwardedStep:
        apply_plan(self, plan)
        forwarded = ForwardedStep()
        if plan.is_empty:
            return forwarded
        inputs = build_step_inputs(
            plan, self.states, self.block_size, self.staging, self.block_table
        )
        if inputs.placeholder_index is not None:
            self._fill_placeholders(inputs)
        graphs = self._graphs_for(inputs)
        if self.lora is not None:
            states = self.states
            requests = [states[rid].lora_request for rid in inputs.request_ids]
            # A verification graph's rows: query_len for each request, padding included.
            rows = inputs.counts if graphs is None else [graphs.query_len] * len(requests)
            unreadable = self.lora.prepare(requests, rows)
            if unreadable:
                forwarded.step.result.failed_requests = {
                    rid: unreadable[lora.lora_int_id]
                    for rid, lora in zip(inputs.request_ids, requests, strict=True)
                    if lora is not None and lora.lora_int_id in unreadable
                }
                logger.warning("%s", "; ".join(sorted(set(unreadable.values()))))
        forwarded.inputs = inputs
        positions = None
        if graphs is not None and uses_mrope(self.model):
            positions = mrope_plain_positions(inputs, self.states)
        if graphs is not None and graphs is self.decode_graphs:
            forwarded.logits = graphs.run(inputs, positions)
            launched()
        else:
            if graphs is not None:  # a verification or prefill graph: the step's hidden states
                hidden = graphs.run(inputs, positions, inputs.counts)
            elif self.embedder is not None:
                hidden = self._forward_multimodal(inputs)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            launched()
            forwarded.hidden = hidden
            if isinstance(self.proposer, EagleProposer):
                self.proposer.record(
                    self.states, inputs.request_ids, inputs.starts, inputs.counts, hidden
                )
            if self.pp is None or self.pp.is_last:
                prompt_logprobs(self.model, self.states, inputs, hidden, forwarded.step.result)
        return forwarded

    def _forward_multimodal(self, inputs: StepInputs) -> torch.Tensor:
        """Image rows over the placeholders (when the step reaches any), model positions."""
        assert self.embedder is not None
        embeds = self.embedder.inputs_embeds(inputs, self.states)
        positions = inputs.positions
        if uses_mrope(self.model):
            positions = step_mrope_positions(inputs, self.states)
        if embeds is None:
            return self.model(inputs.input_ids, positions, self.kv_caches, inputs.meta)
        return self.model(
            inputs.input_ids, positions, self.kv_caches, inputs.meta, inputs_embeds=embeds
        )

    @torch.inference_mode()
    def launch_sampling(
        self, forwarded: ForwardedStep, grammar: Future[GrammarBitmask | None] | None = None
    ) -> LaunchedStep:
        """Enqueue sampling after a forward pass and start copying the sampled ids back.

        `grammar`, when given, resolves to this step's token masks (None when no sampling
        row is constrained); it is waited for only here. Sampling reads the requests' output
        tokens (penalties, seeds, min_tokens) as they stand now: a step collected between
        the two halves has replaced its placeholders by then.
        """
        step = forwarded.step
        inputs = forwarded.inputs
        if inputs is None:
            return step
        sampler_out: SamplerOutput | None = None
        # A stage before the last has no logits: the next plan brings the sampled ids.
        if inputs.sample_request_ids and (self.pp is None or self.pp.is_last):
            if forwarded.logits is not None:
                local = forwarded.logits
            else:
                assert forwarded.hidden is not None
                local = self.model.local_logits(forwarded.hidden[inputs.logits_indices])
            # Only the driver, which samples, receives the whole vocabulary's logits.
            logits = self.tp.gather_last_to_first(local)
            sampler_out = self._sample(
                logits, inputs.sample_request_ids, grammar, inputs.spec_token_ids
            )

        for rid, count in zip(inputs.request_ids, inputs.counts, strict=True):
            self.states[rid].num_computed_tokens += count
        if sampler_out is not None:
            self._start_copy(inputs, sampler_out, step)
        return step

    def _sample(
        self,
        logits: torch.Tensor | None,
        request_ids: list[str],
        grammar: Future[GrammarBitmask | None] | None,
        spec: list[list[int]] | None = None,
    ) -> SamplerOutput | None:
        """Rank 0 samples; under tensor parallelism every other rank takes its ids, so all
        ranks feed the same tokens to the next step (under pipeline parallelism the next
        plan brings them: None here). With proposals (`spec`, per request)
        the logits hold k + 1 rows per request and the ids come back as [B, K + 1]."""
        if self.tp.rank == 0:
            assert logits is not None  # the driver gathered them
            # Filled on the grammar thread while the forward ran.
            bitmask = grammar.result() if grammar is not None else None
            if bitmask is not None:
                row_ids = request_ids if spec is None else expand_request_ids(request_ids, spec)
                apply_grammar_bitmask(logits, bitmask, row_ids)
            columns = self.sampling_columns.gather(request_ids)
            states = list(map(self.states.__getitem__, request_ids))
            rows = sampling_rows(states, columns.seeded, self.generators, self.device)
            if spec is None:
                meta = SamplingMetadata.build(rows, self.vocab_size, self.device, columns)
                out = self.sampler(logits, meta)
            else:
                probs = draft_probs(self.proposer, request_ids, spec)
                out = verify(logits, rows, spec, self.vocab_size, self.device, probs)
        elif self.pp is not None:
            return None  # the next plan brings the sampled ids (core/micro_batches.py)
        else:
            shape = [len(request_ids)] + ([] if spec is None else [max(map(len, spec)) + 1])
            out = SamplerOutput(torch.empty(shape, dtype=torch.int64, device=self.device))
        if self.pp is None:
            self.tp.broadcast_from_first(out.sampled_token_ids)
        return out

    def _fill_placeholders(self, inputs: StepInputs) -> None:
        """Input tokens still being sampled by the step before come from its device tensor."""
        assert inputs.placeholder_index is not None and inputs.placeholder_rows is not None
        source = inputs.placeholder_source
        assert source is not None
        inputs.input_ids[inputs.placeholder_index] = source[inputs.placeholder_rows]

    def _start_copy(self, inputs: StepInputs, out: SamplerOutput, step: LaunchedStep) -> None:
        """Mark each sampled token as a placeholder and start the one device->host copy."""
        sampled = out.sampled_token_ids
        step.sampled = sampled
        states = self.states
        rows = step.rows
        for row, rid in enumerate(inputs.sample_request_ids):
            state = states[rid]
            output = state.output_token_ids
            rows.append((rid, state, len(output)))
            output.append(PLACEHOLDER_TOKEN)
            state.in_flight = (sampled, row)
        tensors = [sampled, out.logprob_token_ids, out.logprobs, out.sampled_ranks]
        if self.device.type != "cuda":
            step.host = tensors
            return
        # Into pinned memory without blocking; collect() waits on the event (releasing
        # the GIL) rather than in a synchronous copy.
        step.host = [t.to("cpu", non_blocking=True) if t is not None else None for t in tensors]
        step.copied = torch.cuda.Event()
        step.copied.record()

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's sampled ids; replace its placeholders by them."""
        result = step.result
        if step.sampled is None:
            return result
        if step.copied is not None:
            step.copied.synchronize()
        sampled, lp_ids, lp_vals, ranks = (t.tolist() if t is not None else None for t in step.host)
        assert sampled is not None
        source = step.sampled
        # [B] one token per row, or [B, K + 1] when verifying proposals.
        one_token = source.dim() == 1
        sampled_token_ids = result.sampled_token_ids
        for row, (rid, state, index) in enumerate(step.rows):
            value = sampled[row]
            # A verifying request gets its accepted proposals and one more (-1 padded).
            tokens = [value] if one_token else [t for t in value if t >= 0]
            state.output_token_ids[index : index + 1] = tokens
            in_flight = state.in_flight
            if in_flight is not None and in_flight[0] is source:
                state.in_flight = None
            sampled_token_ids[rid] = tokens
        if lp_ids is not None and lp_vals is not None:
            for row, (rid, state, _) in enumerate(step.rows):
                num_logprobs = state.sampling_params.logprobs
                if num_logprobs is not None:
                    rank = int(ranks[row]) if ranks is not None else 0
                    entry = row_entry(lp_ids[row], lp_vals[row], rank, num_logprobs)
                    result.logprobs[rid] = [entry]
        if self.proposer is not None:
            states = [state for _, state, _ in step.rows]
            propose(self.proposer, states, result, self.max_model_len)
        return result

    def _graphs_for(self, inputs: StepInputs) -> DecodeGraphs | None:
        """The graphs this step replays (None: eager); not a last prompt token of a request
        with images (its image rows are not in a graph)."""
        graphs = choose_graphs(self.decode_graphs, self.verify_graphs, inputs)
        if graphs is None and self.prefill_graphs:
            return choose_prefill_graph(self.prefill_graphs, inputs)
        if graphs is None or self.embedder is None or past_image_prompts(inputs, self.states):
            return graphs
        return None
