"""Chat templates render as HF's do, sandboxed, with validated messages."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from asyncserve.chat_template import normalize_messages, render_chat_template

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_chatml_with_and_without_generation_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert render_chat_template(CHATML, messages, add_generation_prompt=False) == expected
    assert render_chat_template(CHATML, messages) == expected + "<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_as_hf() -> None:
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    out = render_chat_template(template, [{"role": "user", "content": "a"}])
    assert out == "[a]\n"


def test_helpers_bos_eos_tools_and_extra_kwargs() -> None:
    template = (
        "{{ bos_token }}{{ tools | tojson }}|{{ {'a': '<b>&'} | tojson }}|"
        "{{ strftime_now('%Y') }}|{{ enable_thinking }}{{ eos_token }}"
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = render_chat_template(
        template, [], bos_token="<s>", eos_token="</s>", tools=tools, enable_thinking=False
    )
    year = str(datetime.datetime.now().year)
    # tojson leaves HTML characters alone, unlike jinja2's own filter.
    assert out == f'<s>{json_tools()}|{{"a": "<b>&"}}|{year}|False</s>'


def json_tools() -> str:
    return '[{"type": "function", "function": {"name": "f"}}]'


def test_generation_tag_and_loop_controls() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert render_chat_template(template, messages) == "y"


def test_raise_exception_becomes_value_error() -> None:
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        render_chat_template(template, [{"role": "user", "content": "a"}])


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}",  # syntax error
        "{{ ''.__class__.__mro__ }}",  # sandbox escape attempt
        "{{ messages.append(1) }}",  # mutation in the immutable sandbox
    ],
)
def test_broken_or_unsafe_templates_are_value_errors(template: str) -> None:
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template(template, [{"role": "user", "content": "a"}])


def test_template_failing_on_the_messages_is_a_value_error() -> None:
    # A template that concatenates content fails on null content with a TypeError.
    template = "{% for m in messages %}{{ '<' + m['content'] + '>' }}{% endfor %}"
    with pytest.raises(ValueError, match="chat template error: TypeError"):
        render_chat_template(template, [{"role": "user", "content": None}])


def test_content_parts_are_joined_and_none_kept() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    out = normalize_messages(messages)
    assert out[0] == {"role": "user", "content": "a\nb"}
    assert out[1]["content"] is None and out[1]["tool_calls"] == [{"id": "1"}]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"content": "hi"}], r"messages\[0\].role"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\].content\[0\].*image_url",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\].text"),
        (["hi"], r"messages\[0\] must be an object"),
        ("hi", "messages must be a list"),
    ],
)
def test_bad_messages_raise_naming_the_field(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat_template(CHATML, messages)  # type: ignore[arg-type]
