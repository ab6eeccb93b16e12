"""CUDA graphs for a lone request's prefill: a step of one request whose rows are all prompt
tokens, up to 512 of them.

A lone prompt's eager forward is bound by its launches below several hundred tokens: on an
H200 an 8B model's eager prefill took 18-27 ms for 64 to 500 tokens whatever the length
(~160 Triton launches and ~130 torch ops; 16.5 ms of host time at 641 tokens), for 4-9 ms
of GPU work. With little traffic that is every request's time to first token. One graph per
row count in PREFILL_GRAPH_ROWS (up to the step's token budget) is captured at start-up,
for one request; a step replays the smallest that holds its rows, padded the way a
verification step is (verify_layout.py: padding rows follow the real ones, store no K/V,
and their outputs are dropped). Measured (benchmarks/lone_prefill.py, same call): 64 tokens
8.5 ms against 18.2 eager, 300 tokens 13.4 against 22.8, 500 tokens 13.5 against 27.4, 641
tokens padded to a graph of 768 rows 19.8 against 18.3. So prompts past 512 tokens run
eagerly: their GPU time covers most of their launches, and padding costs about what it saves.
Below 256 rows padding costs more than launches: a 128-token prompt padded to 256 rows ran
the 4-bit model's GEMMs at twice its rows (W2 W4A16's prompt: ~22 ms of its 646), hence
the 64- and 128-row graphs.

Only plain steps replay them: one rank (a graph cannot hold a tensor-parallel all-reduce of
a whole prompt's rows), no pipeline stages, LoRA, speculative decoding or images.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from asyncserve.worker.cuda_graphs import DecodeGraphs, hidden_forward
from asyncserve.worker.input_batch import StepInputs

if TYPE_CHECKING:
    from asyncserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PREFILL_GRAPH_ROWS = (64, 128, 256, 512)


def plain_steps(runner: ModelRunner) -> bool:
    """Whether the runner's steps have none of what a prefill graph cannot hold."""
    return (
        runner.tp.size == 1
        and runner.pp is None
        and runner.lora is None
        and runner.proposer is None
        and runner.embedder is None
    )


def capture_prefill_graphs(runner: ModelRunner, max_model_len: int) -> list[DecodeGraphs]:
    """The prefill graphs, smallest first, in the decode graphs' memory pool (one graph
    replays at a time and its outputs are read before the next, as theirs)."""
    assert runner.decode_graphs is not None
    start = time.perf_counter()
    config = runner.config
    budget = min(config.scheduler.max_num_batched_tokens, max_model_len)
    graphs = [
        DecodeGraphs(
            hidden_forward(runner.model, runner.kv_caches),
            1,
            max_model_len,
            config.cache.block_size,
            runner.device,
            query_len=rows,
            sizes=[1],
            pool=runner.decode_graphs.pool,
        )
        for rows in PREFILL_GRAPH_ROWS
        if rows <= budget
    ]
    for graphs_of_rows in reversed(graphs):  # the largest first: the others reuse its memory
        graphs_of_rows.capture(1)
    if graphs:
        logger.info(
            "captured %d prefill graphs (one request of up to %d rows) in %.1f s",
            len(graphs), graphs[-1].query_len, time.perf_counter() - start,
        )  # fmt: skip
    return graphs


def choose_prefill_graph(graphs: list[DecodeGraphs], inputs: StepInputs) -> DecodeGraphs | None:
    """The graph a step of one request with 2 or more prompt rows replays; None otherwise."""
    if len(inputs.request_ids) != 1 or inputs.spec_token_ids is not None:
        return None
    rows = inputs.counts[0]
    if rows < 2:
        return None
    width = inputs.meta.block_tables.shape[1]
    return next((g for g in graphs if rows <= g.query_len and g.fits(1, width)), None)
