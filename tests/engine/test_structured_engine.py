"""Structured outputs end to end on SmolLM2: every output satisfies its constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from asyncserve import RequestOutputKind, SamplingParams
from asyncserve.core import grammar
from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.llm import LLM
from asyncserve.sampling_params import StructuredOutputsParams

NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}
WORD = {"type": "string", "pattern": "^[a-z]{1,10}$"}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required is not None:
        schema["required"] = required
    return schema


# Every string is bounded by a pattern or an enum, so the longest valid output fits in
# MAX_TOKENS and a correct engine must finish every one of them.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person with a name and an age",
        obj(
            {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            ["name", "age"],
        ),
    ),
    (
        "a color with an optional shade",
        obj(
            {
                "color": {"enum": ["red", "green", "blue"]},
                "shade": {"type": "string", "enum": ["light", "dark"]},
            },
            ["color"],
        ),
    ),
    (
        "a list of two to four fruits",
        {"type": "array", "items": WORD, "minItems": 2, "maxItems": 4},
    ),
    (
        "a user with an id and a nested profile",
        obj(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "profile": obj({"first": NAME, "last": NAME}, ["first", "last"]),
            },
            ["id", "profile"],
        ),
    ),
    (
        "an order of one to three items, each with a SKU and a quantity",
        obj(
            {
                "items": {
                    "type": "array",
                    "items": obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        ["sku", "qty"],
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            ["items"],
        ),
    ),
    (
        "an account that may be active and may have a note",
        obj(
            {"active": {"type": "boolean"}, "note": {"anyOf": [WORD, {"type": "null"}]}},
            ["active", "note"],
        ),
    ),
    (
        "an object whose fields are all optional",
        obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": WORD}),
    ),
    ("a two digit number", {"type": "integer", "minimum": 10, "maximum": 99}),
    (
        "a score, or the word none",
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"enum": ["none"]}]},
    ),
    ("a phone number", {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}),
    (
        "a config with version 2 and a level",
        obj({"version": {"const": 2}, "level": {"enum": [1, 2, 3]}}, ["version", "level"]),
    ),
    (
        "a small matrix of digits",
        obj(
            {
                "matrix": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 3,
                }
            },
            ["matrix"],
        ),
    ),
    (
        "two points",
        {
            "$defs": {
                "point": obj(
                    {
                        "x": {"type": "integer", "minimum": -9, "maximum": 9},
                        "y": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                    ["x", "y"],
                )
            },
            **obj(
                {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}, ["from", "to"]
            ),
        },
    ),
]
MAX_TOKENS = 160


def chat(description: str) -> list[dict[str, str]]:
    # The schema stays out of the prompt: the grammar alone must hold the output to it.
    return [{"role": "user", "content": f"Reply with JSON only: {description}."}]


@pytest.fixture(scope="module")
def llm(smollm2_llm: LLM) -> LLM:
    return smollm2_llm


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.structured.num_requests == 0


def test_json_schemas_hold_for_greedy_sampled_and_n(llm: LLM) -> None:
    modes = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7),
        SamplingParams(temperature=0.8, top_p=0.95, n=2, max_tokens=MAX_TOKENS, seed=11),
    ]
    conversations = []
    params = []
    for description, schema in SCHEMAS:
        for mode in modes:
            conversations.append(chat(description))
            constraint = StructuredOutputsParams(json=schema)
            params.append(_with(mode, constraint))
    outputs = llm.chat(conversations, params, use_tqdm=False)
    checked = 0
    for out, p in zip(outputs, params, strict=True):
        assert p.structured_outputs is not None
        schema = p.structured_outputs.json
        assert out.error is None and len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (schema, completion.text)
            jsonschema.validate(json.loads(completion.text), schema)  # type: ignore[arg-type]
            checked += 1
    assert checked == len(SCHEMAS) * 4
    assert_clean(llm)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    lark = 'start: num (" + " num){1,3}\nnum: /[1-9][0-9]?/'
    cases: list[tuple[str, StructuredOutputsParams]] = [
        ("What is a phone number?", StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")),
        (
            "Is the sky blue? Answer and explain.",
            StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{1,40}\."),
        ),
        (
            "What is the capital of France?",
            StructuredOutputsParams(choice=["Paris", "London", "Berlin"]),
        ),
        ("Add some numbers.", StructuredOutputsParams(grammar=lark)),
    ]
    conversations = []
    params = []
    for temperature in (0.0, 1.0):
        for question, constraint in cases:
            conversations.append(chat(question))
            params.append(
                SamplingParams(
                    temperature=temperature, max_tokens=80, seed=3, structured_outputs=constraint
                )
            )
    outputs = llm.chat(conversations, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    for i in (0, 4):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[i])
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", texts[i + 1])
        assert texts[i + 2] in ("Paris", "London", "Berlin")
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3}", texts[i + 3])
    assert_clean(llm)


def test_json_object(llm: LLM) -> None:
    # json_object bounds nothing, so a prompt the model answers briefly under greedy decoding.
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    prompt = [{"role": "user", "content": 'Return the JSON object {"ok": true}.'}]
    out = llm.chat([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)
    assert_clean(llm)


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.chat([chat("a person")], free, use_tqdm=False)[0].outputs[0]
    schema = SCHEMAS[0][1]
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    both = llm.chat([chat("a person"), chat("a person")], [constrained, free], use_tqdm=False)
    assert both[1].outputs[0].token_ids == alone.token_ids
    assert both[1].outputs[0].text == alone.text
    jsonschema.validate(json.loads(both[0].outputs[0].text), schema)
    # Without the grammar the model does not produce this JSON by itself.
    assert both[0].outputs[0].text != alone.text
    assert_clean(llm)


def test_truncated_constrained_output_finishes_by_length(llm: LLM) -> None:
    schema = SCHEMAS[4][1]
    params = SamplingParams(
        temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=schema)
    )
    out = llm.chat([chat("an order")], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")
    assert_clean(llm)


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
        (StructuredOutputsParams(json="{bad"), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: missing_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraint_raises_before_anything_runs(
    llm: LLM, constraint: StructuredOutputsParams, field: str
) -> None:
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, structured_outputs=constraint),
    ]
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hello", "Hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("Hello", params[1], "bad-constraint")
    assert "bad-constraint" not in llm.engine.output_processor.parents
    assert_clean(llm)


def _with(params: SamplingParams, constraint: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        max_tokens=params.max_tokens,
        structured_outputs=constraint,
    )


def test_abort_drops_the_matcher(llm: LLM) -> None:
    engine = llm.engine
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
    params = SamplingParams(
        n=2,
        temperature=0.0,
        max_tokens=200,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(json=schema),
    )

    async def scenario() -> str:
        stream = engine.generate("Numbers:", params, "aborted-constrained")
        first = await stream.__anext__()
        assert engine.structured.num_requests == 2
        await stream.aclose()  # the reader goes away: the engine aborts both samples
        return first.outputs[0].text

    text = llm._loop.run_until_complete(scenario())
    assert text.startswith("[")
    assert_clean(llm)


def test_a_grammar_that_fails_inside_the_engine_fails_every_time(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pattern too large for llguidance's lexer fails only when a mask is computed (the
    size check before queueing, disabled here, refuses this one). The cached template shares
    the failed lexer: later requests must fail too, not stop at once with nothing made."""
    monkeypatch.setattr(grammar, "check_schema_patterns", lambda schema: None)
    constraint = StructuredOutputsParams(json={"type": "string", "pattern": "^(a{1000}){1000}$"})
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint)
    for _ in range(2):
        out = llm.generate(["Say:"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.token_ids == []
    assert_clean(llm)


def test_allowed_token_ids_that_cannot_start_the_constraint_raise_before_anything_runs(
    llm: LLM,
) -> None:
    tokenizer = llm.get_tokenizer()
    words = tokenizer.encode(" hello", add_special_tokens=False)  # no digit, no "{", no choice
    for constraint in (
        StructuredOutputsParams(choice=["Paris", "Rome"]),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(json_object=True),
    ):
        bad = SamplingParams(max_tokens=4, allowed_token_ids=words, structured_outputs=constraint)
        message = "allowed_token_ids: no allowed token can continue the constrained output"
        with pytest.raises(ValueError, match=message):
            llm.generate(["Hello", "Hello"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
        engine = llm.engine
        assert isinstance(engine, AsyncEngine)
        with pytest.raises(ValueError, match=message):
            engine.add_request("Hello", bad, "allowed-conflict")
        assert "allowed-conflict" not in engine.output_processor.parents
    # Allowed tokens the constraint can start with run, and keep to both.
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    choice = StructuredOutputsParams(choice=["Paris", "Rome"])
    ok = SamplingParams(max_tokens=4, allowed_token_ids=paris + [2], structured_outputs=choice)
    out = llm.generate(["The capital of France is"], ok, use_tqdm=False)[0].outputs[0]
    assert out.text == "Paris" and out.finish_reason == "stop"
    assert_clean(llm)


def test_allowed_token_ids_that_run_out_mid_output_fail_that_request_alone(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    par = tokenizer.encode("Par", add_special_tokens=False)
    assert len(par) == 1 and tokenizer.encode("Paris", add_special_tokens=False) != par
    # "Par" may start "Paris", but "is" (or anything that completes it) is not allowed.
    choice = StructuredOutputsParams(choice=["Paris", "Rome"])
    stuck = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=par,
                           structured_outputs=choice)  # fmt: skip
    free = SamplingParams(temperature=0.0, max_tokens=6)
    alone = llm.generate(["Hello"], free, use_tqdm=False)[0].outputs[0]
    stuck_out, free_out = llm.generate(["Hello", "Hello"], [stuck, free], use_tqdm=False)
    assert stuck_out.error is not None and stuck_out.error.startswith(
        "allowed_token_ids: no allowed token can continue the constrained output"
    ), stuck_out.error
    assert "as output token 2" in stuck_out.error
    assert stuck_out.outputs[0].finish_reason == "error"
    assert free_out.error is None and free_out.outputs[0].token_ids == alone.token_ids
    assert_clean(llm)
