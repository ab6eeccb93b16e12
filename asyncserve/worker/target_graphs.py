"""The target model's CUDA graphs: decode steps (one row a request) and, with speculative
decoding, verification steps (k + 1 rows a request); and which of them a step replays.

A verification graph returns the hidden states, not the logits: the runner takes the logits
of the sampled rows from them as after an eager forward (so the rows feed prompt logprobs
and the rejection sampler alike), and every captured size keeps only [rows, hidden] of its
own, not [rows, vocabulary]. Both sets share one memory pool: one graph replays per step,
its outputs read before the next step's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncserve.config import EngineConfig
from asyncserve.models.base import CausalLM
from asyncserve.spec_decode.eagle_proposer import EagleProposer
from asyncserve.worker.cuda_graphs import DecodeGraphs, hidden_forward, logits_forward
from asyncserve.worker.input_batch import StepInputs
from asyncserve.worker.prefill_graphs import capture_prefill_graphs, plain_steps
from asyncserve.worker.verify_layout import replays_verification, verify_capture_sizes

if TYPE_CHECKING:
    from asyncserve.worker.model_runner import ModelRunner


def capture_step_graphs(runner: ModelRunner, max_model_len: int) -> None:
    """Every graph the runner's steps replay: decode (and verification) steps', the image
    encoder's (worker/encoder_graphs.py) and lone prefills' (worker/prefill_graphs.py)."""
    # A graph cannot hold the stages' sends and receives; an EAGLE head reads the hidden
    # states of every step (EAGLE-3: of inner layers), which the graphs keep.
    if runner.pp is None and not isinstance(runner.proposer, EagleProposer):
        runner.decode_graphs, runner.verify_graphs = capture_target_graphs(
            runner.model, runner.kv_caches, runner.config, max_model_len, runner.device
        )
    if runner.embedder is not None:
        with torch.inference_mode():
            runner.embedder.capture_encoder_graphs(runner.device)
    if runner.decode_graphs is not None and plain_steps(runner):
        runner.prefill_graphs = capture_prefill_graphs(runner, max_model_len)


def max_graph_batch(config: EngineConfig) -> int:
    return min(config.scheduler.max_num_seqs, config.max_cudagraph_capture_size)


def verify_query_len(config: EngineConfig) -> int | None:
    """Query rows a request has in a verification graph (None without speculation)."""
    spec = config.speculative
    return None if spec is None else spec.num_speculative_tokens + 1


def capture_target_graphs(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    config: EngineConfig,
    max_model_len: int,
    device: torch.device,
) -> tuple[DecodeGraphs, DecodeGraphs | None]:
    """Capture the decode graphs and, with speculative decoding, the verification graphs."""
    block_size = config.cache.block_size
    max_batch = max_graph_batch(config)
    decode = DecodeGraphs(
        # This rank's vocabulary slice: the gather to the driver runs after the replay.
        logits_forward(model, kv_caches, model.local_logits),
        max_batch,
        max_model_len,
        block_size,
        device,
    )
    decode.capture_all(compile_first=False)  # compiled with the profile step's kernels
    q = verify_query_len(config)
    if q is None:
        return decode, None
    # A verification step never holds more rows than a step's token budget.
    max_verify = min(max_batch, max(config.scheduler.max_num_batched_tokens // q, 1))
    verify = DecodeGraphs(
        hidden_forward(model, kv_caches),
        max_verify,
        max_model_len,
        block_size,
        device,
        query_len=q,
        sizes=verify_capture_sizes(max_verify),
        pool=decode.pool,
    )
    verify.capture_all("verification")
    return decode, verify


def choose_graphs(
    decode: DecodeGraphs | None, verify: DecodeGraphs | None, inputs: StepInputs
) -> DecodeGraphs | None:
    """The graphs a step replays; None: it runs eagerly. A pure-decode step (one token per
    request, all sampling) replays a decode graph; a step with proposals whose requests
    have at most k + 1 rows each a verification graph (see verify_layout.py)."""
    n = len(inputs.request_ids)
    if (
        decode is not None
        and inputs.meta.max_seqlen_q == 1
        and len(inputs.sample_request_ids) == n
        and decode.padded_size(n) is not None
    ):
        return decode
    if (
        verify is not None
        and inputs.spec_token_ids is not None
        and replays_verification(inputs.counts, verify.query_len, verify.padded_size(n))
    ):
        return verify
    return None
