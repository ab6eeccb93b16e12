"""Grammar compilation, matchers and token bitmasks against SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
import torch
from llguidance import LLMatcher

from asyncserve.core.grammar import StructuredOutputManager, validate_structured_outputs
from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import GrammarBitmask, StepPlan
from asyncserve.sampling_params import SamplingParams, StructuredOutputsParams
from asyncserve.tokenizer import Tokenizer
from asyncserve.worker.grammar_mask import (
    apply_grammar_bitmask,
    apply_token_bitmask_,
    mask_logits_,
    unpack_bitmask_numpy,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    from asyncserve.models.gguf_loader import open_gguf

    return Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.backend, VOCAB, [EOS])


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = unpack_bitmask_numpy(bitmask[row : row + 1], VOCAB)[0]
    return set(torch.nonzero(bits).flatten().tolist())


def matcher_for(manager: StructuredOutputManager, params: StructuredOutputsParams) -> LLMatcher:
    manager.add_request("probe", params)
    state = manager._matchers.pop("probe")
    return state.matcher


def mask_of(manager: StructuredOutputManager, matcher: LLMatcher) -> set[int]:
    return allowed_ids(manager.fill([("probe", matcher)]).bitmask)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json: invalid schema"),
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json: invalid"),
        (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json: invalid schema"),
        (
            StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
            "structured_outputs.json: invalid schema: Unsatisfiable",
        ),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": "a(b"}),
            "structured_outputs.json: invalid schema",
        ),
        (
            StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}),
            "structured_outputs.json: invalid schema",
        ),
        (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex: invalid regex"),
        (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar: invalid"),
        (StructuredOutputsParams(grammar="start: ("), "structured_outputs.grammar: invalid"),
    ],
)
def test_invalid_constraints_name_the_field(
    manager: StructuredOutputManager, params: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_structured_outputs(params)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_structured_outputs(params, manager.tokenizer)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        manager.validate(params)


def test_structured_outputs_params_need_exactly_one_field() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"regex": 5}, "regex"), ({"grammar": b"start: x"}, "grammar"), ({"json_object": 1}, "json")],
)
def test_structured_outputs_fields_of_the_wrong_type_name_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def test_choice_accepts_exactly_the_choices(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    choices = ["yes", "no", 'say "hi"', "naïve café", "two\nlines", "back\\slash"]
    params = StructuredOutputsParams(choice=choices)
    for choice in choices:
        matcher = matcher_for(manager, params)
        assert matcher.consume_tokens(tokenizer.encode(choice, add_special_tokens=False))
        assert matcher.is_accepting(), choice
    for other in ["maybe", "yes!", "nay"]:
        matcher = matcher_for(manager, params)
        assert not matcher.consume_tokens(tokenizer.encode(other, add_special_tokens=False))
        assert matcher.is_error()


def test_thousands_of_choices(manager: StructuredOutputManager, tokenizer: Tokenizer) -> None:
    # Past 2000 alternatives of one parser rule llguidance's Earley row overflows.
    choices = [f"opt{i}" for i in range(5000)]
    params = StructuredOutputsParams(choice=choices)
    for choice in ("opt1", "opt4999"):
        matcher = matcher_for(manager, params)
        assert matcher.consume_tokens(tokenizer.encode(choice, add_special_tokens=False))
        assert matcher.is_accepting(), matcher.get_error()
    matcher = matcher_for(manager, params)
    assert matcher.consume_tokens(tokenizer.encode("opt12", add_special_tokens=False))
    assert EOS in mask_of(manager, matcher)  # opt12 is a choice, and so is opt123
    assert not matcher.consume_tokens(tokenizer.encode("3x", add_special_tokens=False))


def test_regex_mask_allows_digits_and_eos_only_where_accepting(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    matcher = matcher_for(manager, StructuredOutputsParams(regex=r"[0-9]{2,3}"))
    first = mask_of(manager, matcher)
    assert first and EOS not in first
    for token in first:
        text = tokenizer.decode([token])
        assert text.isdigit() and 1 <= len(text) <= 3, repr(text)
    one = tokenizer.encode("1", add_special_tokens=False)
    assert matcher.consume_tokens(one)
    assert EOS not in mask_of(manager, matcher)  # one digit: not yet accepting
    assert matcher.consume_tokens(one)
    after_two = mask_of(manager, matcher)
    assert EOS in after_two and matcher.is_accepting() and not matcher.is_stopped()
    assert matcher.consume_tokens(one)
    assert matcher.is_stopped()
    assert mask_of(manager, matcher) == {EOS}


def test_every_engine_eos_id_is_allowed_at_accepting_states(tokenizer: Tokenizer) -> None:
    im_start = tokenizer.backend.token_to_id("<|im_start|>")
    manager = StructuredOutputManager(tokenizer.backend, VOCAB, [EOS, 0])
    matcher = matcher_for(manager, StructuredOutputsParams(regex="a+"))
    assert matcher.consume_tokens(tokenizer.encode("a", add_special_tokens=False))
    allowed = mask_of(manager, matcher)
    assert {EOS, 0} <= allowed and im_start not in allowed


def test_json_object_and_schema_masks(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    matcher = matcher_for(manager, StructuredOutputsParams(json_object=True))
    first = mask_of(manager, matcher)
    assert all(tokenizer.decode([t]).startswith("{") for t in first)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    matcher = matcher_for(manager, StructuredOutputsParams(json=schema))
    assert matcher.consume_tokens(tokenizer.encode('{"n":42', add_special_tokens=False))
    assert EOS not in mask_of(manager, matcher)
    assert matcher.consume_tokens(tokenizer.encode("}", add_special_tokens=False))
    assert matcher.is_stopped()


def test_unpack_follows_the_bit_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    for vocab in (160, 150, 200):
        expected = torch.zeros(3, min(vocab, 160), dtype=torch.bool)
        for r in range(3):
            for t in range(min(vocab, 160)):
                expected[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
        assert torch.equal(unpack_bitmask_numpy(bitmask, vocab), expected)


def test_apply_masks_only_constrained_rows_in_sampling_order() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 100
    logits = torch.randn(4, vocab, generator=gen)
    original = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    # Mask rows belong to requests "d" and "b"; "x" does not sample this step.
    grammar = GrammarBitmask(["d", "b"], bitmask)
    apply_grammar_bitmask(logits, grammar, ["a", "b", "c", "d"])
    allowed = unpack_bitmask_numpy(bitmask, vocab)
    for row, mask_row in ((3, 0), (1, 1)):
        expected = original[row].masked_fill(~allowed[mask_row], float("-inf"))
        assert torch.equal(logits[row], expected)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])

    full = original[:2].clone()
    apply_grammar_bitmask(full, GrammarBitmask(["x", "y"], bitmask), ["x", "y"])
    assert torch.equal(full, original[:2].masked_fill(~allowed, float("-inf")))

    # Logits wider than the bitmask: ids past it are never allowed.
    wide = torch.zeros(2, 130)
    mask_logits_(wide, unpack_bitmask_numpy(torch.full((1, 4), -1, dtype=torch.int32), 130), [1])
    assert torch.isinf(wide[1, 128:]).all() and (wide[1, :128] == 0).all()
    assert (wide[0] == 0).all()
    wide = torch.zeros(1, 130)
    apply_token_bitmask_(wide, torch.full((1, 4), -1, dtype=torch.int32), None)
    assert torch.isinf(wide[0, 128:]).all() and (wide[0, :128] == 0).all()


def _request(rid: str, params: SamplingParams, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, max_tokens=32)


def test_accept_tokens_stops_errors_and_drops_finished(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    params = SamplingParams(structured_outputs=choice)
    reqs = {rid: _request(rid, params, [1, 2, 3]) for rid in ("ok", "bad", "done", "partial")}
    for rid in reqs:
        manager.add_request(rid, choice)
    alpha = tokenizer.encode("alpha", add_special_tokens=False)
    reqs["ok"].output_token_ids.extend(alpha)
    reqs["bad"].output_token_ids.extend(tokenizer.encode("gamma", add_special_tokens=False))
    reqs["done"].output_token_ids.append(EOS)
    reqs["done"].status = RequestStatus.FINISHED_STOPPED
    reqs["partial"].output_token_ids.extend(alpha[:1])
    result = manager.accept_tokens(reqs.values())
    assert result.stopped == (["ok"] if len(alpha) > 1 else ["ok", "partial"])
    assert [rid for rid, _ in result.errored] == ["bad"]
    assert "structured output failed" in result.errored[0][1]
    assert not manager.has_request("done") and not manager.has_request("ok")
    if len(alpha) > 1:
        # Only the new tokens are consumed on the next call.
        reqs["partial"].output_token_ids.extend(alpha[1:])
        assert manager.accept_tokens([reqs["partial"]]).stopped == ["partial"]
    manager.remove(["partial"])
    assert manager.num_requests == 0


def test_submit_fills_only_constrained_rows_that_sample(manager: StructuredOutputManager) -> None:
    regex = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(structured_outputs=regex)
    reqs = {
        "free": _request("free", SamplingParams(), [5, 6, 7]),
        "decode": _request("decode", params, [5, 6, 7]),
        "prefill": _request("prefill", params, [5, 6, 7, 8, 9]),
    }
    manager.add_request("decode", regex)
    manager.add_request("prefill", regex)
    plan = StepPlan(num_scheduled_tokens={"free": 3, "decode": 3, "prefill": 2})
    plan.total_num_scheduled_tokens = 8
    # As after schedule(): the plan's tokens already count as computed.
    reqs["free"].num_computed_tokens = 3
    reqs["decode"].num_computed_tokens = 3
    reqs["prefill"].num_computed_tokens = 2
    future = manager.submit(plan, reqs.get)
    assert future is not None
    grammar = future.result()
    assert grammar.request_ids == ["decode"]
    assert grammar.bitmask.shape == (1, VOCAB // 32) and grammar.bitmask.dtype == torch.int32
    assert EOS not in allowed_ids(grammar.bitmask)
    only_free = StepPlan(num_scheduled_tokens={"free": 1}, total_num_scheduled_tokens=1)
    assert manager.submit(only_free, reqs.get) is None
    manager.remove(["decode", "prefill"])
    assert manager.submit(plan, reqs.get) is None


def test_allowed_token_ids_against_the_grammar(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    choice = StructuredOutputsParams(choice=["Paris", "Rome"])
    digits = tokenizer.encode("123", add_special_tokens=False)
    par = tokenizer.encode("Par", add_special_tokens=False)
    message = "allowed_token_ids: no allowed token can continue the constrained output"
    with pytest.raises(ValueError, match=message):
        manager.validate(choice, digits)
    manager.validate(choice, par)  # "Par" can start "Paris"
    manager.validate(choice, None)
    # Past "Par" only "is" (or the like) continues: with "Par" alone allowed, every logit
    # was masked and whatever was drawn is rejected with that reason, not a parse error.
    reqs = {
        rid: _request(rid, SamplingParams(structured_outputs=choice, allowed_token_ids=allowed),
                      [1, 2, 3])
        for rid, allowed in (("stuck", par), ("free", None))
    }  # fmt: skip
    for rid, req in reqs.items():
        manager.add_request(rid, choice)
        req.output_token_ids.extend(par + digits[:1])
    result = manager.accept_tokens(reqs.values())
    errors = dict(result.errored)
    assert errors["stuck"].startswith(message) and "as output token 2" in errors["stuck"]
    assert errors["free"].startswith("structured output failed: ")
    assert manager.num_requests == 0


def test_llguidance_tokenizer_is_built_on_first_use(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its build holds the GIL for up to a second: not at start-up, once, by the first user.
    import asyncserve.core.grammar as grammar

    builds: list[int] = []
    real = grammar.build_ll_tokenizer

    def counting(*args: object) -> object:
        builds.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar, "build_ll_tokenizer", counting)
    fresh = StructuredOutputManager(tokenizer.backend, VOCAB, [EOS])
    assert builds == []
    fresh.validate(StructuredOutputsParams(regex="[0-9]+"))
    fresh.validate(StructuredOutputsParams(choice=["yes", "no"]))
    assert builds == [1]
    fresh.shutdown()


def test_llguidance_tokenizer_ignores_padding_and_truncation(tokenizer: Tokenizer) -> None:
    from asyncserve.core.grammar import build_ll_tokenizer

    text = "Hello, structured world! " * 4
    expected = tokenizer.encode(text, add_special_tokens=False)
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    backend.enable_padding(length=len(expected) + 10, pad_id=0)
    backend.enable_truncation(max_length=4)
    built = build_ll_tokenizer(backend, VOCAB, [EOS])
    assert built.tokenize_str(text) == expected
    assert backend.padding is not None and backend.truncation is not None  # left as it was
    assert build_ll_tokenizer(tokenizer.backend, VOCAB, [EOS]).tokenize_str(text) == expected
