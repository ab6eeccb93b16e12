"""Verification steps as their CUDA graphs run them, on the CPU: which steps replay a graph
of k + 1 query rows a request, where a step's rows go when some requests have fewer, and
that a step copied into the graph buffers (padded inside requests and up to the captured
batch size) gives the eager step's logits and K/V. (Capture and replay themselves run on the
GPU: tests/spec_decode/test_spec_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import ModelConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.loader import LoadedModel, load_model
from asyncserve.worker.cuda_graphs import DecodeGraphs, hidden_forward
from asyncserve.worker.input_batch import StepInputs
from asyncserve.worker.kv_pool import allocate_kv_caches
from asyncserve.worker.target_graphs import choose_graphs
from asyncserve.worker.verify_layout import (
    FREE_ROWS,
    pad_rows,
    replays_verification,
    verify_capture_sizes,
)
from tests.models.test_loader import random_state, write_config

CPU = torch.device("cpu")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 64
NUM_BLOCKS = 40


def test_capture_sizes_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert verify_capture_sizes(1) == [1]
    assert verify_capture_sizes(8) == [1, 2, 4, 8]
    assert verify_capture_sizes(24) == [1, 2, 4, 8, 16, 24]


def test_pad_rows_places_each_request_at_a_multiple_of_q() -> None:
    assert pad_rows([4, 4, 4], 4) is None  # uniform: copied as it is
    layout = pad_rows([4, 2, 1, 3], 4)
    assert layout is not None
    # Step rows: request 0 at 0-3, 1 at 4-5, 2 at 6, 3 at 7-9.
    assert layout.rows.tolist() == [0, 1, 2, 3, 4, 5, 8, 12, 13, 14]
    # Padding rows repeat their request's last real row.
    assert layout.source.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 6, 6, 6, 6, 7, 8, 9, 9]
    assert layout.extra.tolist() == [0, 2, 3, 1]
    for bad in ([5, 1], [0, 2]):
        with pytest.raises(ValueError, match="query rows per request"):
            pad_rows(bad, 4)


def test_which_steps_replay_a_verification_graph() -> None:
    q = 4
    assert replays_verification([4, 4, 4], q, 4)  # uniform
    assert replays_verification([4, 1, 2], q, 4)  # fewer proposals: padded
    assert replays_verification([2], q, 1)
    assert not replays_verification([4, 5], q, 2)  # a prompt chunk longer than q
    assert not replays_verification([4, 4], q, None)  # past the largest captured batch
    assert not replays_verification([], q, 1)
    # Past FREE_ROWS, padding may at most double the rows.
    big = FREE_ROWS // q * 2
    assert replays_verification([4] * big, q, big)
    assert replays_verification([2] * big, q, big)
    assert not replays_verification([1] * (big - 1) + [4], q, big)


def _inputs(counts: list[int], spec: bool, max_q: int | None = None) -> StepInputs:
    n = len(counts)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(counts), dtype=torch.int64),
        cu_seqlens_q=torch.zeros(n + 1, dtype=torch.int32),
        seq_lens=torch.ones(n, dtype=torch.int32),
        block_tables=torch.zeros((n, 1), dtype=torch.int32),
        max_seqlen_q=max(counts) if max_q is None else max_q,
        max_seqlen_k=1,
    )
    ids = [f"r{i}" for i in range(n)]
    return StepInputs(
        input_ids=torch.zeros(sum(counts), dtype=torch.int64),
        positions=torch.zeros(sum(counts), dtype=torch.int64),
        meta=meta,
        request_ids=ids,
        starts=[0] * n,
        counts=counts,
        sample_request_ids=ids,
        logits_indices=torch.zeros(0, dtype=torch.int64),
        spec_token_ids=[[0] * (c - 1) for c in counts] if spec else None,
    )


def test_choose_graphs() -> None:
    def forward(*_: object) -> tuple[torch.Tensor, ...]:
        raise AssertionError("choosing runs no forward")

    decode = DecodeGraphs(forward, 8, MAX_MODEL_LEN, BLOCK_SIZE, CPU)
    verify = DecodeGraphs(
        forward, 8, MAX_MODEL_LEN, BLOCK_SIZE, CPU, query_len=4, sizes=verify_capture_sizes(8)
    )
    assert choose_graphs(decode, verify, _inputs([1, 1, 1], spec=False)) is decode
    assert choose_graphs(decode, verify, _inputs([4, 4], spec=True)) is verify
    assert choose_graphs(decode, verify, _inputs([4, 1, 3], spec=True)) is verify
    assert choose_graphs(decode, None, _inputs([4, 1, 3], spec=True)) is None
    assert choose_graphs(decode, verify, _inputs([4, 6], spec=True)) is None  # a prompt chunk
    assert choose_graphs(decode, verify, _inputs([4] * 9, spec=True)) is None  # past 8
    # A step without proposals: a short prompt chunk runs eagerly, as before.
    assert choose_graphs(decode, verify, _inputs([3, 1], spec=False)) is None


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = write_config(tmp_path_factory.mktemp("verify") / "llama")
    save_file(random_state(seed=3), str(root / "model.safetensors"))
    return load_model(ModelConfig(model=str(root), dtype="float32"), CPU)


def _step(
    starts: list[int], counts: list[int], tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and metadata of a step: request i's rows at positions
    starts[i] to starts[i] + counts[i] - 1."""
    counts_np = np.asarray(counts)
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts_np, out=cu[1:])
    positions = np.arange(cu[-1]) - np.repeat(cu[:-1], counts_np) + np.repeat(starts, counts_np)
    request = np.repeat(np.arange(len(counts)), counts_np)
    slots = tables.numpy()[request, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    seq_lens = np.asarray(starts) + counts_np
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        cu_seqlens_q=torch.from_numpy(cu).to(torch.int32),
        seq_lens=torch.from_numpy(seq_lens).to(torch.int32),
        block_tables=tables,
        max_seqlen_q=int(counts_np.max()),
        max_seqlen_k=int(seq_lens.max()),
    )
    ids = torch.randint(3, 250, (int(cu[-1]),))
    return ids, torch.from_numpy(positions), meta


def _kv(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for layer in caches for t in layer]


def _restore(caches: list[tuple[torch.Tensor, torch.Tensor]], saved: list[torch.Tensor]) -> None:
    for cache, tensor in zip([t for layer in caches for t in layer], saved, strict=True):
        cache.copy_(tensor)


# (k, starts, counts): batches padded to a captured size, requests with fewer than k
# proposals (padded inside), uniform steps, and a request at the end of max_model_len (its
# padding rows reach past it).
STEPS = [
    (3, [5, 17, 40], [4, 2, 1]),
    (3, [9, 20, 33, 3, 50], [4, 4, 4, 4, 4]),
    (3, [62], [2]),
    (3, [60, 7], [4, 1]),
    (1, [5, 17, 40], [2, 1, 2]),
    (1, [9, 20, 33, 3, 50, 62], [2, 2, 2, 2, 2, 2]),
    (1, [63, 30], [1, 2]),
]


@pytest.mark.parametrize(("k", "starts", "counts"), STEPS)
def test_verification_step_in_graph_buffers_equals_eager(
    loaded: LoadedModel, k: int, starts: list[int], counts: list[int]
) -> None:
    model = loaded.model
    torch.manual_seed(0)
    caches = allocate_kv_caches(loaded.arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
    for key, value in caches:  # earlier positions' K/V for the step to read
        key.normal_()
        value.normal_()
    blocks = torch.randperm(NUM_BLOCKS - 1)[: 4 * len(starts)] + 1
    tables = blocks.view(len(starts), 4).to(torch.int32)
    graphs = DecodeGraphs(hidden_forward(model, caches), 8, MAX_MODEL_LEN, BLOCK_SIZE, CPU,
                          query_len=k + 1, sizes=verify_capture_sizes(8))  # fmt: skip
    # A step of other requests first: stale buffer rows must not leak into the next.
    other = _step([20] * 8, [k + 1] * 8, tables[[0] * 8])
    _ = graphs.forward_eagerly(*other)
    ids, positions, meta = _step(starts, counts, tables)

    before = _kv(caches)
    with torch.inference_mode():
        eager = model.local_logits(model(ids, positions, caches, meta))
    eager_kv = _kv(caches)
    assert any(not torch.equal(a, b) for a, b in zip(before, eager_kv, strict=True))

    _restore(caches, before)
    with torch.inference_mode():
        (hidden,) = graphs.forward_eagerly(ids, positions, meta, counts)
        logits = model.local_logits(hidden)
    assert logits.shape == (sum(counts), 300)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    # The step's K/V as the eager step's; padding rows and padding requests wrote nothing.
    for a, b in zip(_kv(caches), eager_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    size = graphs.padded_size(len(counts))
    assert size is not None and size >= len(counts)
    _, _, padded = graphs.inputs(size)
    assert padded.cu_seqlens_q.tolist() == list(range(0, size * (k + 1) + 1, k + 1))
    assert (padded.max_seqlen_q, padded.max_seqlen_k) == (k + 1, MAX_MODEL_LEN + k)
    assert padded.seq_lens.tolist() == [s + k + 1 for s in starts] + [k + 1] * (size - len(starts))
    assert int((padded.slot_mapping >= 0).sum()) == sum(counts)


def _counting_buffers(
    model: CausalLM,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    k: int,
    seen: list[list[int]],
) -> DecodeGraphs:
    """Verification graph buffers whose replay runs the forward on them eagerly, keeping
    each step's query rows per request in `seen`."""
    graphs = DecodeGraphs(hidden_forward(model, caches), 8, MAX_MODEL_LEN, BLOCK_SIZE, CPU,
                          query_len=k + 1, sizes=verify_capture_sizes(8))  # fmt: skip

    def replay(ids, positions, meta, counts=None):  # type: ignore[no-untyped-def]
        seen.append(counts)
        return graphs.forward_eagerly(ids, positions, meta, counts)

    graphs.replay = replay  # type: ignore[method-assign]
    return graphs


@pytest.mark.parametrize("k", [1, 3])
def test_engine_verification_through_graph_buffers_equals_decoding(tmp_path: Path, k: int) -> None:
    """The runner's verification steps through the graph buffers (run eagerly in place of
    a replay): greedy output is what decoding without speculation gives, and both uniform
    steps (k proposals each) and padded ones (fewer) took that path. The proposer offers
    len(tokens) % (k + 1) of the last tokens: prompts of one length keep in step (uniform
    steps; most proposals are rejected), prompts of different lengths do not (padded)."""
    from asyncserve import SamplingParams
    from asyncserve.llm import LLM

    root = write_config(tmp_path / "llama")
    save_file(random_state(seed=5), str(root / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    batches = [
        [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()}
         for n in lengths]
        for lengths in ((6, 6, 6), (5, 9, 6, 11))
    ]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": k}
    outputs = []
    seen: list[list[int]] = []
    for speculative in (None, spec):
        llm = LLM(str(root), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory=4 << 20, speculative_config=speculative)  # fmt: skip
        try:
            runner = llm.engine.runner
            assert runner is not None
            if speculative is not None:
                assert runner.proposer is not None
                runner.proposer.propose = (  # type: ignore[method-assign,union-attr]
                    lambda tokens: tokens[len(tokens) - len(tokens) % (k + 1) :].tolist()
                )
                runner.verify_graphs = _counting_buffers(runner.model, runner.kv_caches, k, seen)
            got = [llm.generate(prompts, params, use_tqdm=False) for prompts in batches]
            outputs.append([list(o.outputs[0].token_ids) for batch in got for o in batch])
        finally:
            llm.close()
    assert outputs[1] == outputs[0]
    assert any(set(counts) == {k + 1} for counts in seen), seen
    assert any(min(counts) < k + 1 for counts in seen), seen
