"""OutputProcessor: sampled tokens -> RequestOutputs for n samples, stop strings, ends from
outside the step, and a failure that stays with its request."""

from __future__ import annotations

import asyncio

import pytest

from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import StepResult
from asyncserve.output.output_processor import OutputProcessor, ParentState
from asyncserve.output.request_stream import RequestStream
from asyncserve.sampling_params import RequestOutputKind, SamplingParams
from asyncserve.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level(300, None, [299])


def add(proc: OutputProcessor, rid: str, n: int, **params: object) -> RequestStream:
    sampling = SamplingParams(n=n, output_kind=RequestOutputKind.DELTA, **params)  # type: ignore[arg-type]
    stream = RequestStream(rid, sampling.output_kind)
    children = [Request(f"{rid}#{i}", [104, 105], sampling) for i in range(n)]
    proc.add(ParentState(rid, "hi", [104, 105], sampling, stream), children)
    return stream


def emit(proc: OutputProcessor, tokens: dict[str, int], finished: set[str] = frozenset()):  # type: ignore[assignment, no-untyped-def]
    requests = []
    for rid, token in tokens.items():
        request = proc.children[rid][1].request
        request.output_token_ids.append(token)
        if rid in finished:
            request.status = RequestStatus.FINISHED_LENGTH
        requests.append(request)
    return proc.process(requests, StepResult(sampled_token_ids={r: [t] for r, t in tokens.items()}))


def get(stream: RequestStream):  # type: ignore[no-untyped-def]
    return asyncio.run(stream.get())


def test_n_samples_stream_deltas_and_finish_once() -> None:
    proc = OutputProcessor(TOKENIZER, 1, None)
    stream = add(proc, "a", 2)
    emit(proc, {"a#0": ord("x"), "a#1": ord("y")})
    first = get(stream)
    assert [(c.index, c.text) for c in first.outputs] == [(0, "x"), (1, "y")]
    assert not first.finished
    emit(proc, {"a#0": ord("z")}, finished={"a#0"})
    second = get(stream)
    assert [(c.index, c.text, c.finish_reason) for c in second.outputs] == [(0, "z", "length")]
    emit(proc, {"a#1": ord("w")}, finished={"a#1"})
    last = get(stream)
    assert last.finished and [c.index for c in last.outputs] == [1]
    assert "a" not in proc.parents


def test_stop_string_ends_the_sample_and_is_reported() -> None:
    proc = OutputProcessor(TOKENIZER, 1, None)
    stream = add(proc, "s", 1, stop=["!"])
    processed = emit(proc, {"s#0": ord("o")})
    assert processed.stopped == []
    processed = emit(proc, {"s#0": ord("!")})
    assert processed.stopped == ["s#0"]
    out = get(stream)
    assert out.finished and out.outputs[0].text == "o" and out.outputs[0].stop_reason == "!"


def test_finish_from_outside_publishes_the_end() -> None:
    proc = OutputProcessor(TOKENIZER, 1, None)
    stream = add(proc, "f", 2)
    proc.finish(["f#0", "f#1"], "abort")
    out = get(stream)
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert proc.siblings(["f#0"]) == []  # forgotten once published


def test_a_failing_request_does_not_stop_the_others(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    proc = OutputProcessor(TOKENIZER, 1, None)
    good = add(proc, "g", 1)
    bad = add(proc, "b", 1)
    update = proc.children["b#0"][1].detokenizer.update

    def failing(*args):  # type: ignore[no-untyped-def]
        raise ValueError("broken detokenizer")

    monkeypatch.setattr(proc.children["b#0"][1].detokenizer, "update", failing)
    processed = emit(proc, {"g#0": ord("k"), "b#0": ord("k")})
    assert processed.failed == ["b#0"]
    failed = get(bad)
    assert failed.finished and failed.internal_error and "broken detokenizer" in failed.error
    assert get(good).outputs[0].text == "k" and "g" in proc.parents
    assert update is not None


def add_final(proc: OutputProcessor, rid: str, **params: object) -> RequestStream:
    sampling = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)  # type: ignore[arg-type]
    stream = RequestStream(rid, sampling.output_kind)
    request = Request(f"{rid}#0", [104, 105], sampling)
    proc.add(ParentState(rid, "hi", [104, 105], sampling, stream), [request])
    return stream


def test_detokenize_false_gives_token_ids_without_text_or_decoded_tokens() -> None:
    proc = OutputProcessor(TOKENIZER, 1, None)
    stream = add(proc, "d", 1, detokenize=False, logprobs=1)
    request = proc.children["d#0"][1].request
    request.output_token_ids.extend([ord("o"), ord("k")])
    request.status = RequestStatus.FINISHED_LENGTH
    logprobs = [({ord("o"): -0.1, ord("p"): -2.0}, 1), ({ord("k"): -0.2}, 1)]
    proc.process([request], StepResult(logprobs={"d#0": logprobs}))
    out = get(stream).outputs[0]
    assert out.text == "" and out.token_ids == [ord("o"), ord("k")]
    assert out.logprobs is not None and len(out.logprobs) == 2
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())


def test_a_deferred_request_is_taken_whole_at_its_end() -> None:
    """A final-only request without stop strings or logprobs is detokenized once, when it
    ends, to the same text a step-by-step one gets."""
    tokens = [ord(c) for c in "hello world"]
    proc = OutputProcessor(TOKENIZER, 1, None)
    deferred = add_final(proc, "x")
    eager = add_final(proc, "y", logprobs=0)
    assert proc.parents["x"].deferred and not proc.parents["y"].deferred
    x, y = proc.children["x#0"][1].request, proc.children["y#0"][1].request
    assert x.tokens_read_at_end and not y.tokens_read_at_end
    for i, token in enumerate(tokens):
        x.output_token_ids.append(token)
        emit(proc, {"y#0": token}, finished={"y#0"} if i == len(tokens) - 1 else set())
    x.status = RequestStatus.FINISHED_LENGTH
    proc.process([x], StepResult())
    a, b = get(deferred).outputs[0], get(eager).outputs[0]
    assert a.text == b.text == "hello world" and a.token_ids == b.token_ids == tokens


def test_an_aborted_deferred_request_returns_its_output_so_far() -> None:
    proc = OutputProcessor(TOKENIZER, 1, None)
    stream = add_final(proc, "a")
    proc.children["a#0"][1].request.output_token_ids.extend([ord("o"), ord("k")])
    proc.finish(["a#0"], "abort")
    out = get(stream).outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("ok", [ord("o"), ord("k")], "abort")


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize"):
        SamplingParams(stop=["!"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a boolean"):
        SamplingParams(detokenize="no")  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop == []
