"""The proposers' one-token steps as their CUDA graphs run them, on the CPU: a step copied
into the graph buffers and padded to its captured batch size gives each request the eager
step's outputs and K/V, and the padding rows write nothing. (Capture and replay themselves
run on the GPU: tests/spec_decode/test_spec_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncserve.config import ModelConfig
from asyncserve.models.loader import load_model
from asyncserve.spec_decode.config import SpeculativeConfig
from asyncserve.spec_decode.draft_proposer import DraftProposer
from asyncserve.spec_decode.eagle_proposer import EagleProposer
from asyncserve.spec_decode.model_proposer import ModelProposer
from asyncserve.worker.cuda_graphs import DecodeGraphs
from tests.spec_decode.test_eagle import CONFIG, _save_head, target  # noqa: F401

CPU = torch.device("cpu")
BLOCK_SIZE = 16
MAX_BATCH = 8
MAX_MODEL_LEN = 64
# Three requests (a batch padded to 4) at these positions, in their own blocks.
POSITIONS = [5, 17, 40]
TABLES = torch.tensor([[1, 7, 0], [2, 3, 0], [4, 5, 6]], dtype=torch.int32)
TOKENS = torch.tensor([11, 200, 37])


def _draft(path: Path) -> DraftProposer:
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(path))
    return DraftProposer(spec, CONFIG["vocab_size"], torch.float32, CPU, BLOCK_SIZE)


def _eagle(path: Path, head: str) -> EagleProposer:
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, model=head)
    model = load_model(ModelConfig(model=str(path), dtype="float32"), CPU).model
    return EagleProposer(spec, model, torch.float32, CPU, BLOCK_SIZE)


def _with_graph_buffers(proposer: ModelProposer) -> DecodeGraphs:
    proposer.allocate_kv_cache(num_blocks=8)
    torch.manual_seed(0)
    for key, value in proposer.kv_caches:  # earlier positions' K/V for the step to read
        key.normal_()
        value.normal_()
    proposer.use_cuda_graphs(MAX_BATCH, MAX_MODEL_LEN)
    assert proposer.graphs is not None
    return proposer.graphs


def _kv(proposer: ModelProposer) -> list[torch.Tensor]:
    return [t.clone() for layer in proposer.kv_caches for t in layer]


def _restore(proposer: ModelProposer, saved: list[torch.Tensor]) -> None:
    caches = [t for layer in proposer.kv_caches for t in layer]
    for cache, tensor in zip(caches, saved, strict=True):
        cache.copy_(tensor)


def test_fill_pads_to_the_captured_size() -> None:
    def forward(*_: object) -> tuple[torch.Tensor, ...]:
        raise AssertionError("filling runs no forward")

    graphs = DecodeGraphs(forward, 20, MAX_MODEL_LEN, BLOCK_SIZE, CPU)
    assert graphs.sizes == [1, 2, 4, 8, 16, 20]
    proposer = ModelProposer()
    proposer.block_size, proposer.device = BLOCK_SIZE, CPU
    # A step of four requests first: the next step's padding row must not keep its values.
    four = [*POSITIONS, 9]
    pos_t, meta, _ = proposer._layout(four, [p + 1 for p in four], TABLES[[0, 1, 2, 0]])
    assert graphs.fill(torch.tensor([1, 2, 3, 4]), pos_t, meta) == 4
    pos_t, meta, _ = proposer._layout(POSITIONS, [p + 1 for p in POSITIONS], TABLES)
    assert graphs.fill(TOKENS, pos_t, meta) == 4
    ids, positions, padded = graphs.inputs(4)
    assert ids[:3].tolist() == TOKENS.tolist() and positions[:3].tolist() == POSITIONS
    slots = [int(TABLES[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, p in enumerate(POSITIONS)]  # fmt: skip
    assert padded.slot_mapping.tolist() == [*slots, -1]
    assert padded.seq_lens.tolist() == [6, 18, 41, 1]
    assert padded.block_tables[:3, :3].tolist() == TABLES.tolist()
    assert padded.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert (padded.max_seqlen_q, padded.max_seqlen_k) == (1, MAX_MODEL_LEN)
    # Past the largest size, or block tables wider than max_model_len needs: eager.
    assert graphs.fits(20, 4) and not graphs.fits(21, 4) and not graphs.fits(3, 5)


def test_draft_step_in_graph_buffers_equals_eager(target: Path) -> None:  # noqa: F811
    proposer = _draft(target)
    graphs = _with_graph_buffers(proposer)
    pos_t, meta, chosen = proposer._one_token_inputs(POSITIONS, TABLES)
    assert chosen is graphs
    before = _kv(proposer)
    (eager,) = proposer._decode_forward(TOKENS, pos_t, meta)
    eager_kv = _kv(proposer)
    assert any(not torch.equal(a, b) for a, b in zip(before, eager_kv, strict=True))

    _restore(proposer, before)
    size = graphs.fill(TOKENS, pos_t, meta)
    (padded,) = graphs.forward(*graphs.inputs(size))
    assert padded.shape == (4, CONFIG["vocab_size"])
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(_kv(proposer), eager_kv, strict=True):  # the padding row wrote nothing
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_eagle_step_in_graph_buffers_equals_eager(target: Path, tmp_path: Path) -> None:  # noqa: F811
    torch.manual_seed(1)
    proposer = _eagle(target, _save_head(tmp_path / "head"))
    graphs = _with_graph_buffers(proposer)
    assert proposer._hidden_in is not None and proposer._hidden_in.shape[0] == MAX_BATCH
    hidden = torch.randn(len(POSITIONS), CONFIG["hidden_size"])
    pos_t, meta, chosen = proposer._one_token_inputs(POSITIONS, TABLES)
    assert chosen is graphs
    before = _kv(proposer)
    eager = proposer._head_step(TOKENS, hidden, pos_t, meta)
    eager_kv = _kv(proposer)

    _restore(proposer, before)
    proposer._hidden_in[:3].copy_(hidden)  # as propose() does before a replay
    size = graphs.fill(TOKENS, pos_t, meta)
    logits, fed_back = graphs.forward(*graphs.inputs(size))
    assert logits.shape == (4, CONFIG["vocab_size"])
    torch.testing.assert_close(logits[:3], eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fed_back[:3], eager[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(_kv(proposer), eager_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    # More requests than the largest captured batch: the step runs eagerly.
    many = MAX_BATCH + 1
    tables = TABLES[:1].repeat(many, 1)
    assert proposer._one_token_inputs([5] * many, tables)[2] is None
