"""LLM.chat: the template, tools and chat_template_kwargs, message checks and vLLM's
continue_final_message."""

from __future__ import annotations

from typing import Any

import pytest

from asyncserve import SamplingParams
from asyncserve.llm import LLM

USER = {"role": "user", "content": "Hi"}
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_assistant_tool_call_without_content_renders_as_empty(smollm2_llm: LLM) -> None:
    # OpenAI's shape for a turn that only calls tools: content null, as the HTTP route takes it.
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "ok", "tool_call_id": "1"},
    ]
    out = smollm2_llm.chat(messages, PARAMS, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids
    no_content = smollm2_llm.chat([USER, {"role": "assistant"}, USER], PARAMS, use_tqdm=False)
    assert no_content[0].error is None


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be given"),
        (
            [USER, {"role": "assistant", "content": "a"}, {"role": "user"}],
            r"messages\[2\]\.content",
        ),
        ([[USER], [{"role": "system"}, USER]], r"messages\[1\]\[0\]\.content must be given"),
    ],
)
def test_missing_content_is_named(smollm2_llm: LLM, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        smollm2_llm.chat(messages, PARAMS, use_tqdm=False)
    _assert_idle(smollm2_llm)


def test_continue_final_message_leaves_the_final_turn_open(smollm2_llm: LLM) -> None:
    messages = [USER, {"role": "assistant", "content": "The answer is"}]
    decode = smollm2_llm.get_tokenizer().decode
    for kwargs in (
        {"continue_final_message": True},
        {"chat_template_kwargs": {"continue_final_message": True}},
    ):
        out = smollm2_llm.chat(
            messages, PARAMS, use_tqdm=False, add_generation_prompt=False, **kwargs
        )[0]
        assert decode(out.prompt_token_ids, False).endswith("assistant\nThe answer is")
    closed = smollm2_llm.chat(messages, PARAMS, use_tqdm=False, add_generation_prompt=False)[0]
    assert not decode(closed.prompt_token_ids, False).endswith("The answer is")


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        ([USER], {"continue_final_message": True}, "cannot both be true"),
        (
            [USER, {"role": "assistant", "content": ""}],
            {"continue_final_message": True, "add_generation_prompt": False},
            "final message with non-empty content",
        ),
        ([USER], {"continue_final_message": "yes"}, "continue_final_message must be a boolean"),
    ],
)
def test_bad_continue_final_message(
    smollm2_llm: LLM, messages: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        smollm2_llm.chat(messages, PARAMS, use_tqdm=False, **kwargs)
    _assert_idle(smollm2_llm)


def test_chat_uses_template(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = smollm2_llm.chat([{"role": "user", "content": "Say hello."}], params, use_tqdm=False)[0]
    assert out.outputs[0].text
    assert "<|im_start|>" in smollm2_llm.get_tokenizer().decode(out.prompt_token_ids, False)


def test_chat_passes_tools_to_the_template(smollm2_llm: LLM) -> None:
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = smollm2_llm.chat(
        [{"role": "user", "content": "Hi"}],
        params,
        use_tqdm=False,
        tools=[tool],
        chat_template_kwargs={"chat_template": template},
    )[0]
    assert smollm2_llm.get_tokenizer().decode(out.prompt_token_ids, False) == "[get_weather]Hi"


def test_chat_template_kwargs_override_the_arguments(smollm2_llm: LLM) -> None:
    # vLLM's LLM.chat lets chat_template_kwargs set add_generation_prompt (and tools).
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = smollm2_llm.chat(messages, params, use_tqdm=False, add_generation_prompt=True,
                   chat_template_kwargs={"add_generation_prompt": False})[0]  # fmt: skip
    text = smollm2_llm.get_tokenizer().decode(out.prompt_token_ids, False)
    assert not text.rstrip().endswith("assistant")
    with pytest.raises(ValueError, match="chat_template_kwargs must not set 'bos_token'"):
        smollm2_llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"bos_token": "x"})


def test_chat_content_the_template_cannot_render_is_a_value_error(smollm2_llm: LLM) -> None:
    failing = {"chat_template": "{{ messages[0].content + 1 }}"}
    with pytest.raises(ValueError, match="chat template error"):
        smollm2_llm.chat(
            [{"role": "user", "content": "Hi"}], use_tqdm=False, chat_template_kwargs=failing
        )
    assert smollm2_llm.engine.num_running == 0 and smollm2_llm.engine.num_waiting == 0
