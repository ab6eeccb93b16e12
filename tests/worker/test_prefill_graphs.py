"""Lone prefills as their CUDA graphs run them (worker/prefill_graphs.py), on the CPU: which
steps replay a prefill graph, and that a lone prompt chunk copied into a graph's buffers
(padded to its rows) gives the eager step's logits and K/V: from position 0, after a cached
prefix, exactly the graph's rows, and at the end of max_model_len. On the GPU: capture at
start-up and greedy tokens and prompt logprobs equal to the eager path's (skipped without
CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncserve import SamplingParams
from asyncserve.config import ModelConfig
from asyncserve.llm import LLM
from asyncserve.models.loader import LoadedModel, load_model
from asyncserve.worker.cuda_graphs import DecodeGraphs, hidden_forward
from asyncserve.worker.kv_pool import allocate_kv_caches
from asyncserve.worker.prefill_graphs import PREFILL_GRAPH_ROWS, choose_prefill_graph
from tests.models.test_loader import random_state, write_config
from tests.worker.test_verify_graphs import (
    BLOCK_SIZE,
    CPU,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    _inputs,
    _kv,
    _restore,
    _step,
)


def _graphs(forward: object, rows: list[int]) -> list[DecodeGraphs]:
    return [
        DecodeGraphs(forward, 1, MAX_MODEL_LEN, BLOCK_SIZE, CPU, query_len=q, sizes=[1])  # type: ignore[arg-type]
        for q in rows
    ]


def test_choose_prefill_graph() -> None:
    def forward(*_: object) -> tuple[torch.Tensor, ...]:
        raise AssertionError("choosing runs no forward")

    small, large = _graphs(forward, [16, 48])
    assert choose_prefill_graph([small, large], _inputs([2], spec=False)) is small
    assert choose_prefill_graph([small, large], _inputs([16], spec=False)) is small
    assert choose_prefill_graph([small, large], _inputs([17], spec=False)) is large
    assert choose_prefill_graph([small, large], _inputs([49], spec=False)) is None  # too long
    assert choose_prefill_graph([small, large], _inputs([1], spec=False)) is None  # decode
    assert choose_prefill_graph([small, large], _inputs([8, 8], spec=False)) is None  # two
    assert choose_prefill_graph([small, large], _inputs([4], spec=True)) is None  # proposals
    assert choose_prefill_graph([], _inputs([8], spec=False)) is None


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = write_config(tmp_path_factory.mktemp("prefill") / "llama")
    save_file(random_state(seed=4), str(root / "model.safetensors"))
    return load_model(ModelConfig(model=str(root), dtype="float32"), CPU)


# (graph rows, first position, prompt rows): from 0; after a cached prefix; exactly the
# graph's rows; the chunk ending at max_model_len (its padding's context reaches past it).
CHUNKS = [(48, 0, 40), (48, 10, 30), (16, 5, 16), (48, 30, 34)]


@pytest.mark.parametrize(("q", "start", "count"), CHUNKS)
def test_prefill_in_graph_buffers_equals_eager(
    loaded: LoadedModel, q: int, start: int, count: int
) -> None:
    model = loaded.model
    torch.manual_seed(1)
    caches = allocate_kv_caches(loaded.arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
    for key, value in caches:  # the cached prefix's K/V
        key.normal_()
        value.normal_()
    tables = (torch.randperm(NUM_BLOCKS - 1)[:4] + 1).view(1, 4).to(torch.int32)
    (graphs,) = _graphs(hidden_forward(model, caches), [q])
    # Another prompt first: stale buffer rows must not leak into the next.
    _ = graphs.forward_eagerly(*_step([0], [q // 2], tables), [q // 2])
    ids, positions, meta = _step([start], [count], tables)

    before = _kv(caches)
    with torch.inference_mode():
        eager = model.local_logits(model(ids, positions, caches, meta))
    eager_kv = _kv(caches)
    _restore(caches, before)
    with torch.inference_mode():
        (hidden,) = graphs.forward_eagerly(ids, positions, meta, [count])
        logits = model.local_logits(hidden)
    assert logits.shape == (count, 300)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(_kv(caches), eager_kv, strict=True):  # padding rows wrote nothing
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lone_prefills_replay_and_equal_eager(tmp_path: Path) -> None:
    root = write_config(tmp_path / "llama", max_position_embeddings=2048)
    save_file(random_state(seed=6), str(root / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    lengths = (2, 9, 100, 255, 256, 300, 700, 768, 1500)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    prompts.append(prompts[5][:200] + prompts[6][:50])  # a cached 192-token prefix, then 58
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    tokens: dict[bool, list[list[int]]] = {}
    prompt_logprobs: dict[bool, list[list[float]]] = {}
    for eager in (False, True):
        llm = LLM(str(root), device="cuda", dtype="float32", max_model_len=2048,
                  enforce_eager=eager, gpu_memory_utilization=0.2)  # fmt: skip
        try:
            runner = llm.engine.runner
            assert runner is not None
            rows = [g.query_len for g in runner.prefill_graphs]
            assert rows == ([] if eager else list(PREFILL_GRAPH_ROWS))
            got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one by one
            tokens[eager] = [list(o.outputs[0].token_ids) for o in got]
            # Each prompt token's own logprob (positions 1 on), from the step's hidden rows.
            prompt_logprobs[eager] = [
                [entry[t].logprob for t, entry in zip(p[1:], (o.prompt_logprobs or [])[1:], strict=True)]
                for p, o in zip(prompts, got, strict=True)
            ]  # fmt: skip
        finally:
            llm.close()
    assert tokens[False] == tokens[True]
    for graphed, eager_lps in zip(prompt_logprobs[False], prompt_logprobs[True], strict=True):
        torch.testing.assert_close(
            torch.tensor(graphed), torch.tensor(eager_lps), atol=1e-3, rtol=0
        )
