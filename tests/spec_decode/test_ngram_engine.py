"""N-gram speculative decoding end to end on SmolLM2: the same tokens as without it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import PLAIN_PROMPTS

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, " * 3 + "1, 2, 3,"
LETTERS = "a b c d e f g h " * 4 + "a b c"
FOX = "the quick brown fox jumps over the lazy dog. " * 3 + "the quick brown"
REPEATING = [COUNTING, LETTERS, FOX]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


@pytest.fixture(scope="module")
def spec_llm(gguf_path: object) -> Iterator[LLM]:
    llm = LLM(device="cpu", max_model_len=512, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    yield llm
    llm.close()


def _ids(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_decoding_without_speculation(spec_llm: LLM, smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = PLAIN_PROMPTS[:3] + REPEATING
    stats = spec_llm.engine.scheduler.spec_stats
    before = stats.num_draft_tokens
    assert _ids(spec_llm, prompts, params) == _ids(smollm2_llm, prompts, params)
    assert stats.num_draft_tokens > before


def test_acceptance_on_a_repeating_prompt(spec_llm: LLM) -> None:
    stats = spec_llm.engine.scheduler.spec_stats
    drafts, draft_tokens, accepted = (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    out = spec_llm.generate(
        [COUNTING], SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 48
    rounds = stats.num_drafts - drafts
    rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - draft_tokens)
    assert rate > 0.9, rate
    # 47 tokens after the first in about a fifth as many steps.
    assert rounds <= 12, rounds


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7])
def test_max_tokens_is_never_overshot(spec_llm: LLM, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = spec_llm.generate([LETTERS], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"


def test_stop_strings_and_stop_tokens(spec_llm: LLM, smollm2_llm: LLM) -> None:
    ids = _ids(smollm2_llm, [COUNTING], SamplingParams(temperature=0.0, max_tokens=20))[0]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=40, stop=["7,"]),
        # A stop token in the middle of an accepted run of proposals ends the output there.
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[9]]),
    ):
        ours = spec_llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
        theirs = smollm2_llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
        assert (ours.text, ours.token_ids, ours.finish_reason) == (
            theirs.text,
            theirs.token_ids,
            theirs.finish_reason,
        )
        assert ours.finish_reason == "stop"


def test_requests_that_decode_one_token_a_step_in_the_same_batch(
    spec_llm: LLM, smollm2_llm: LLM
) -> None:
    """Penalties, logprobs and grammars are verified one token a step, beside requests
    that speculate, with the same results."""
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3)
    logprobs = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    grammar = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(choice=["1, 2, 3", "a b c d"]),
    )
    prompts = [COUNTING, LETTERS, COUNTING, FOX]
    params = [plain, penalized, logprobs, grammar]
    ours = spec_llm.generate(prompts, params, use_tqdm=False)
    theirs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    got, want = ours[2].outputs[0].logprobs, theirs[2].outputs[0].logprobs
    assert got is not None and want is not None and len(got) == len(want) == 24
    for x, y in zip(got, want, strict=True):
        assert x.keys() == y.keys()
        for token in x:
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


def test_sampling_with_n_and_seeds_is_reproducible(spec_llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, n=3, seed=11)
    first = spec_llm.generate([COUNTING], params, use_tqdm=False)[0]
    again = spec_llm.generate([COUNTING], params, use_tqdm=False)[0]
    assert len(first.outputs) == 3
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert all(len(o.token_ids) == 16 for o in first.outputs)


def test_prefix_hits_and_preemption_keep_the_output(gguf_path: object, smollm2_llm: LLM) -> None:
    """A pool of 12 blocks of 16 tokens cannot hold four 70-token requests at once:
    requests are preempted and recomputed (with prefix hits) mid-speculation."""
    llm = LLM(
        device="cpu",
        max_model_len=192,  # what the 12 blocks hold
        num_gpu_blocks_override=12,
        max_num_seqs=4,
        speculative_config=NGRAM,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=32)
        prompts = [COUNTING, LETTERS, FOX, COUNTING]
        ours = _ids(llm, prompts, params)
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert llm.engine.scheduler.prefix_cache_hits > 0
    finally:
        llm.close()
    assert ours == _ids(smollm2_llm, prompts, params)


@pytest.mark.parametrize(
    ("regex", "accepts"),
    [
        # The proposals (the prompt's "4, 5, 6, ...") fit the grammar: they are accepted.
        (r"( ?[0-9]+,)+", True),
        # The prompt's proposals do not fit; the grammar rules them out.
        (r"[a-z ]+", False),
    ],
)
def test_grammar_checks_the_proposals(
    spec_llm: LLM, smollm2_llm: LLM, regex: str, accepts: bool
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    stats = spec_llm.engine.scheduler.spec_stats
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    ours = spec_llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
    theirs = smollm2_llm.generate([COUNTING], params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert ours.text == theirs.text
    assert stats.num_draft_tokens > drafts
    if accepts:
        rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts)
        assert rate > 0.5, rate
    else:
        assert all(t.isalpha() or t == " " for t in ours.text), ours.text


def test_grammar_completed_by_accepted_proposals(spec_llm: LLM, smollm2_llm: LLM) -> None:
    """The proposals "4, 5, 6, 7, 8" complete the choice: the output ends there (no EOS
    from the step's extra token), as one token a step would."""
    choice = StructuredOutputsParams(choice=["4, 5, 6, 7, 8", "d e f g"])
    for ignore_eos in (False, True):
        params = SamplingParams(
            temperature=0.0, max_tokens=30, structured_outputs=choice, ignore_eos=ignore_eos
        )
        ours = spec_llm.generate([COUNTING, LETTERS], params, use_tqdm=False)
        theirs = smollm2_llm.generate([COUNTING, LETTERS], params, use_tqdm=False)
        for a, b in zip(ours, theirs, strict=True):
            got, want = a.outputs[0], b.outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
                want.stop_reason,
            )
    assert spec_llm.engine.num_free_blocks == spec_llm.engine.num_blocks


def test_seeded_output_does_not_depend_on_the_batch(spec_llm: LLM) -> None:
    """A seeded request's steps without proposals draw as they would alone, also when
    another request in the step verifies proposals."""
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=3)
    alone = _ids(spec_llm, [LETTERS], seeded)
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    outs = spec_llm.generate([COUNTING, LETTERS], [greedy, seeded], use_tqdm=False)
    assert list(outs[1].outputs[0].token_ids) == alone[0]
