"""One request's failure stays its own: a request whose output processing raises ends with
finish_reason "error" while the others in the same steps finish normally, and the engine
serves the next request. Also the request that used to stop the engine: n > 1 with prompt
logprobs."""

from __future__ import annotations

import pytest

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.output.output_processor import OutputProcessor


def assert_pool_whole(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_n_samples_with_prompt_logprobs(smollm2_llm: LLM) -> None:
    prompt = "Paris is a city in"
    n_prompt = len(smollm2_llm.get_tokenizer().encode(prompt))
    params = SamplingParams(n=2, prompt_logprobs=1, logprobs=1, max_tokens=4, temperature=0.0)
    out = smollm2_llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.error is None
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n_prompt
    assert out.prompt_logprobs[0] is None
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert entry is not None and token in entry
    # Greedy: both samples agree, and the engine still serves.
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    again = smollm2_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    assert again[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert_pool_whole(smollm2_llm)


def test_output_processing_error_fails_only_its_request(
    smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output processing raises for one request (any request whose params ask for 3 top
    logprobs): it ends with an error, the other requests finish, the engine goes on."""
    original = OutputProcessor._append_logprobs

    def failing(self, child, result, rid):  # type: ignore[no-untyped-def]
        if child.request.sampling_params.logprobs == 3 and child.request.num_output_tokens >= 2:
            raise IndexError("injected failure")
        return original(self, child, result, rid)

    monkeypatch.setattr(OutputProcessor, "_append_logprobs", failing)
    good = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    bad = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, n=2)
    prompts = ["The capital of France is", "Water boils at", "The sky is"]
    outs = smollm2_llm.generate(prompts, [good, bad, good], use_tqdm=False)
    assert outs[1].error is not None and "injected failure" in outs[1].error
    assert outs[1].internal_error
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    for i in (0, 2):
        assert outs[i].error is None
        assert len(outs[i].outputs[0].token_ids) == 8
        assert outs[i].outputs[0].finish_reason == "length"
    assert smollm2_llm.engine.is_running
    assert_pool_whole(smollm2_llm)
    monkeypatch.undo()
    after = smollm2_llm.generate(prompts[:1], good, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_logprobs_across_prefill_chunks() -> None:
    """A prompt prefilled in several chunks gets logprobs for every position (chunks that
    sample nothing included)."""
    llm = LLM(device="cpu", max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=16)
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen " * 2
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    assert n_prompt > 16
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    entries = out[0].prompt_logprobs
    assert entries is not None and len(entries) == n_prompt and entries[0] is None
    for token, entry in zip(out[0].prompt_token_ids[1:], entries[1:], strict=True):
        assert entry is not None and token in entry
    llm.close()
