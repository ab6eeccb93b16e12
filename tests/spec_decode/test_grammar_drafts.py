"""Grammar masks for a step that verifies proposals: one row per proposed position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.core.step import GrammarBitmask
from asyncserve.sampling_params import StructuredOutputsParams
from asyncserve.tokenizer import Tokenizer
from asyncserve.worker.grammar_mask import apply_grammar_bitmask
from tests.core.test_grammar import EOS, VOCAB, allowed_ids, mask_of, matcher_for


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    from asyncserve.models.gguf_loader import open_gguf

    return Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.backend, VOCAB, [EOS])


def test_rows_follow_the_proposals_and_the_matcher_rolls_back(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    matcher = matcher_for(manager, StructuredOutputsParams(regex="ab(c|d)e"))
    a, b, c, d, x = (tokenizer.backend.token_to_id(t) for t in "abcdx")
    before = mask_of(manager, matcher)
    # "a b x c": the third proposal breaks the grammar.
    masks = manager.fill_with_drafts([("r", matcher)], {"r": [a, b, x, c]})
    assert masks.request_ids == ["r"] * 5
    rows = [allowed_ids(masks.bitmask, i) for i in range(5)]
    assert a in rows[0] and b not in rows[0]
    assert b in rows[1] and a not in rows[1]
    assert {c, d} <= rows[2] and x not in rows[2]  # the breaking proposal is ruled out
    assert rows[3] == rows[4] == set(range(VOCAB))  # past it: nothing is kept anyway
    # The matcher is where it was: the proposals were not consumed.
    assert mask_of(manager, matcher) == before


def test_masks_land_on_each_requests_rows() -> None:
    """Rows of the bitmask under a request's id go to that request's consecutive logits
    rows, in order; rows of other requests are untouched."""
    logits = torch.zeros(5, 64)
    words = torch.zeros(3, 2, dtype=torch.int32)
    for row, token in enumerate([3, 4, 5]):
        words[row, 0] = 1 << token
    masks = GrammarBitmask(["g", "g", "g"], words)
    apply_grammar_bitmask(logits, masks, ["plain", "g", "g", "g", "other"])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[4]).all()
    for row, token in zip((1, 2, 3), (3, 4, 5), strict=True):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == [token]
