"""The offline API: input forms, order, sampling features, errors, and block accounting."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from asyncserve import RequestOutputKind, SamplingParams
from asyncserve.llm import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256, kv_cache_memory=64 << 20)


def assert_pool_whole(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_generate_outputs_in_input_order(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The sky is", "1, 2, 3,"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        assert o.finished and o.outputs[0].text and len(o.outputs[0].token_ids) <= 8
    assert_pool_whole(llm)


def test_token_id_prompts_and_dicts(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("The sky is")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    a = llm.generate([ids], params, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    c = llm.generate(ids, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_seed_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=12)
    alone = llm.generate(["Tell me a story"], seeded, use_tqdm=False)[0]
    batch = llm.generate(
        ["Some other text", "Tell me a story", "More"], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_samples_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=2)
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for comp in out.outputs:
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
            assert token in entry
    assert_pool_whole(llm)


def test_stop_string_never_in_text(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Count: 1, 2, 3,"], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate(["Count: 1, 2, 3,"], params, use_tqdm=False)[0].outputs[0]
    assert stop not in out.text
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_max_tokens_and_min_tokens(llm: LLM) -> None:
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prompt_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert entry is not None and token in entry


def test_too_long_prompt_fails_alone(llm: LLM) -> None:
    long_prompt = " ".join(["word"] * 400)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate(["Short prompt", long_prompt], params, use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason in ("length", "stop")
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[1].error is not None
    assert "256" in outputs[1].error and str(len(outputs[1].prompt_token_ids)) in outputs[1].error
    assert_pool_whole(llm)


def test_lone_surrogate_fails_its_prompt_alone(llm: LLM) -> None:
    # "\ud800" is a str Python holds but no tokenizer takes: that prompt's error, not a
    # TypeError out of the whole call; likewise in bad_words, tokenized for the request.
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outputs = llm.generate(["Hi", "a\ud800b"], params, use_tqdm=False)
    assert outputs[0].error is None and outputs[0].outputs[0].token_ids
    assert outputs[1].error is not None and "lone surrogate" in outputs[1].error
    bad = SamplingParams(max_tokens=2, bad_words=["\udc00"])
    assert "lone surrogate" in (llm.generate("Hi", bad, use_tqdm=False)[0].error or "")
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"logprobs": -2}, "logprobs"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"n": True}, "n"),
        ({"stop": 5}, "stop"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (None, "prompts must be"),
        (5, "prompts must be"),
        ([[1.5, 2]], r"prompts\[0\]\[0\] must be a token id"),
        ([[1, "a"]], r"prompts\[0\]\[1\] must be a token id"),
        ([1, "a"], r"prompts\[0\] must be"),
        ([True, False], r"prompts\[0\] must be"),
        ({"prompt": None}, "needs 'prompt' or 'prompt_token_ids'"),
        ({"prompt": 5}, r"\['prompt'\] must be a string"),
        ({"prompt_token_ids": "abc"}, "must be a list of token ids"),
        (["ok", {"prompt_token_ids": [1, None]}], r"prompts\[1\]\['prompt_token_ids'\]\[1\]"),
        ({"prompt": "Hi", "multi_modal_data": 5}, "multi_modal_data must be a dict"),
    ],
)
def test_malformed_prompts_raise_before_any_work(llm: LLM, prompts: object, match: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0
    after = llm.generate("Hi", params, use_tqdm=False)[0]
    assert after.error is None and after.outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampling_params": [None]}, r"sampling_params\[0\] must be a SamplingParams"),
        ({"sampling_params": {"max_tokens": 2}}, "sampling_params must be a SamplingParams"),
        ({"priority": ["high"]}, "priority must be an integer"),
        ({"priority": 5}, "priority must be a list"),
        ({"lora_request": 5}, "lora_request must be a LoRARequest, a list of them or None"),
        ({"lora_request": [5]}, r"lora_request\[0\] must be a LoRARequest"),
    ],
)
def test_bad_params_or_priorities_raise_before_any_work(
    llm: LLM, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate("Hi", use_tqdm=False, **kwargs)  # type: ignore[arg-type]
    # The engine refuses it too: a priority queue would fail comparing it, request queued.
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request("Hi", SamplingParams(max_tokens=1), "bad-priority", None)  # type: ignore[arg-type]
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0


def test_chat_template_kwargs_must_be_a_dict(llm: LLM) -> None:
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs=5)  # type: ignore[arg-type]
    # Its keys name the template's variables: not a TypeError from the template call.
    with pytest.raises(ValueError, match="chat_template_kwargs keys must be strings, got 1"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={1: True})  # type: ignore[dict-item]


def test_empty_stop_string_is_named_as_sent() -> None:
    with pytest.raises(ValueError, match="stop must be a non-empty string or a list"):
        SamplingParams(stop="")


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        ([[]], {}, r"messages\[0\] must contain at least one message"),
        ([[{"role": "user", "content": "Hi"}], []], {}, r"messages\[1\] must contain"),
        ([], {}, "messages must contain at least one message"),
        ([{"role": "user", "content": "Hi"}], {"tools": [5]}, r"tools\[0\] must be an object"),
        ([{"role": "user", "content": "Hi"}], {"tools": 5}, "tools must be a list"),
    ],
)
def test_bad_chat_input_raises_before_any_work(
    llm: LLM, messages: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False, **kwargs)
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0


def test_logit_bias_forces_and_forbids(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    first = llm.generate("The sky is", plain, use_tqdm=False)[0].outputs[0].token_ids[0]
    forced = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={42: 100})
    assert (
        list(llm.generate("The sky is", forced, use_tqdm=False)[0].outputs[0].token_ids) == [42] * 3
    )
    banned = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={first: -100})
    assert first not in llm.generate("The sky is", banned, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="logit_bias.*out-of-vocab"):
        llm.generate("Hi", SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)


def test_top_k_past_the_vocabulary_means_no_top_k(llm: LLM) -> None:
    # As vLLM: a top_k of the vocabulary's size or more keeps every token. One past int64
    # once failed the worker's step, and with it the engine and every request on it.
    vocab = llm.engine.loaded.arch.vocab_size
    plain = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    expected = llm.generate("The sky is", plain, use_tqdm=False)[0].outputs[0].token_ids
    for top_k in (vocab, 2**70):
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=3, top_k=top_k)
        out = llm.generate("The sky is", params, use_tqdm=False)[0]
        assert out.error is None and out.outputs[0].token_ids == expected
        assert params.top_k == top_k  # the caller's params are left as they are
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text
    assert_pool_whole(llm)


def test_truncate_prompt_tokens_over_max_model_len(llm: LLM) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens value .257. is greater"):
        llm.generate("Hi", SamplingParams(truncate_prompt_tokens=257), use_tqdm=False)


def test_logprobs_over_max_logprobs(llm: LLM) -> None:
    # The bound is LLM's max_logprobs (20 by default, as in vLLM), not SamplingParams'.
    with pytest.raises(ValueError, match="logprobs.*max allowed: 20"):
        llm.generate("Hi", SamplingParams(logprobs=50, max_tokens=1), use_tqdm=False)


def test_logprobs_bounded_by_the_vocabulary(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # max_logprobs=-1 is vLLM's "no cap": up to the vocabulary, never past it (a top-k over
    # more than the vocabulary would fail the step and with it the engine).
    monkeypatch.setattr(llm, "max_logprobs", -1)
    vocab = llm.engine.loaded.arch.vocab_size
    out = llm.generate("Hi", SamplingParams(logprobs=30, max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 30  # type: ignore[index]
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            llm.generate("Hi", SamplingParams(max_tokens=1, **{name: vocab + 1}), use_tqdm=False)
        ids = llm.get_tokenizer().encode("Hi")
        with pytest.raises(ValueError, match=name):
            llm.engine.validate_request(ids, SamplingParams(max_tokens=1, **{name: vocab + 1}))
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text
    assert_pool_whole(llm)


def test_logprobs_minus_one_is_the_whole_vocabulary(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's -1: logprobs of every vocabulary token, when max_logprobs allows that many.
    vocab = llm.engine.loaded.arch.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{name}: requested -1 .*max allowed: 20"):
            llm.generate("Hi", SamplingParams(max_tokens=1, **{name: -1}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)
    monkeypatch.setattr(llm, "max_logprobs", -1)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate("The sky is", params, use_tqdm=False)[0]
    assert params.logprobs == params.prompt_logprobs == -1  # the caller's are left as they are
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == 2
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert len(entry) == vocab and token in entry
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert [len(e or {}) for e in out.prompt_logprobs[1:]] == [vocab] * (
        len(out.prompt_token_ids) - 1
    )
    assert_pool_whole(llm)


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine

    async def scenario() -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        keep = asyncio.create_task(_collect(engine.generate("Kept request", params, "keep")))
        gen = engine.generate("Aborted request", params, "gone")
        await gen.__anext__()
        await gen.aclose()  # the reader goes away: the engine aborts the request
        texts = await keep
        assert texts

    llm._loop.run_until_complete(scenario())
    assert_pool_whole(llm)


async def _collect(stream) -> str:  # type: ignore[no-untyped-def]
    text = ""
    async for out in stream:
        text += out.outputs[0].text if out.outputs else ""
    return text


def test_detokenize_false_gives_the_same_tokens_without_text(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The sky is"]
    with_text = SamplingParams(temperature=0.0, max_tokens=8)
    ids_only = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    # With logprobs the outputs are taken step by step (not deferred to the end).
    stepwise = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    texts = llm.generate(prompts, with_text, use_tqdm=False)
    ids = llm.generate(prompts, ids_only, use_tqdm=False)
    steps = llm.generate(prompts, stepwise, use_tqdm=False)
    for a, b, c in zip(texts, ids, steps, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.outputs[0].text and a.outputs[0].text == c.outputs[0].text
        assert b.outputs[0].text == ""
    with pytest.raises(ValueError, match="detokenize"):
        llm.generate(prompts, SamplingParams(stop=["."], detokenize=False), use_tqdm=False)
    assert_pool_whole(llm)


def test_offline_batch_limits(llm: LLM) -> None:
    """Unset, an offline engine takes vLLM-like large-batch limits on a GPU and serving's on
    CPU; values given are kept."""
    from asyncserve.config.sections import offline_batch_limits

    scheduler = llm.engine.config.scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 2048)
    assert offline_batch_limits(None, None, on_gpu=True) == (512, 16384)
    assert offline_batch_limits(None, None, on_gpu=False) == (256, 2048)
    assert offline_batch_limits(64, None, on_gpu=True) == (64, 16384)
    assert offline_batch_limits(None, 4096, on_gpu=True) == (512, 4096)


def test_closed_llm_says_so() -> None:
    closed = LLM(device="cpu", max_model_len=64, num_gpu_blocks_override=8)
    closed.close()
    with pytest.raises(RuntimeError, match="LLM is closed"):
        closed.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RuntimeError, match="LLM is closed"):
        closed.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    closed.close()  # twice is harmless


def test_interrupted_generate_aborts_its_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C during generate(): a KeyboardInterrupt out of the event loop. The call's other
    # requests must not stay running (holding KV blocks, stepping in the next call).
    class Interrupting:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def update(self, n: int) -> None:
            raise KeyboardInterrupt

        def close(self) -> None:
            pass

    with monkeypatch.context() as patch:
        patch.setattr("asyncserve.llm.tqdm", Interrupting)
        params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=200, ignore_eos=True)]
        with pytest.raises(KeyboardInterrupt):  # the patched bar interrupts: it must exist
            llm.generate(["Hi", "Once upon a time"], params, use_tqdm=True)
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0
    assert_pool_whole(llm)
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text


def test_generate_from_two_threads_runs_both(llm: LLM) -> None:
    # One event loop per LLM: a second thread's call waits for the first, not a RuntimeError.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["Hi", "Sky"], params, use_tqdm=False)]
    results: list[Any] = [None, None]

    def call(i: int) -> None:
        with contextlib.suppress(Exception):  # a failed call leaves its None
            outs = llm.generate(["Hi", "Sky"], params, use_tqdm=False)
            results[i] = [o.outputs[0].token_ids for o in outs]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [expected, expected]
    assert_pool_whole(llm)


def test_engine_lifetime_freezes_the_startup_heap() -> None:
    """While an LLM is open its start-up heap is out of the collector's view (long generate
    calls' full collections walk only what they allocate); close() gives it back, so the
    closed engine's reference cycles can be collected, and restores the thresholds."""
    import gc
    import weakref

    from asyncserve.gc_heap import MIDDLE_THRESHOLD, YOUNG_THRESHOLD

    thresholds = gc.get_threshold()
    before = [object()]  # a container made before the engine
    llm = LLM(device="cpu", max_model_len=128, kv_cache_memory=16 << 20)
    try:
        assert id(before) not in {id(o) for o in gc.get_objects()}
        assert gc.get_threshold()[:2] == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD)
        engine = weakref.ref(llm.engine)
    finally:
        llm.close()
    assert gc.get_threshold() == thresholds
    assert id(before) in {id(o) for o in gc.get_objects()}
    del llm
    gc.collect()
    assert engine() is None  # nothing frozen keeps the closed engine alive
