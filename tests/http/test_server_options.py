"""vLLM's server options through one real server started with them (some from --config):
--root-path, /invocations, /load, chat batch, forced usage, per-request metrics, token ids in
logprobs, --max-logprobs -1, --chat-template, --generation-config, CORS, X-Request-Id, and
tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import ServerProcess, require_model, sse_events

pytestmark = pytest.mark.timeout(300)
ORIGIN = "https://app.example"
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def options_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model()
    root = tmp_path_factory.mktemp("options")
    (root / "template.jinja").write_text(TEMPLATE)
    gen = root / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    config = {
        "served-model-name": ["from-config"],  # overridden on the command line below
        "enable_request_id_headers": True,
        "enable-per-request-metrics": True,
        "enable-server-load-tracking": True,
        "generation-config": str(gen),
        "allowed-origins": [ORIGIN],
        "max-model-len": 1024,
        "kv-cache-memory": "128M",
        "enable-auto-tool-choice": True,
        "tool-call-parser": "hermes",
    }
    (root / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    args = [
        "--config", str(root / "config.yaml"),
        "--served-model-name", "opts",
        "--root-path", "/llm",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--max-logprobs", "-1",
        "--chat-template", str(root / "template.jinja"),
        "--shutdown-timeout", "5",
    ]  # fmt: skip
    proc = ServerProcess(args, root)
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.logs()[-4000:]


@pytest.fixture()
def http(options_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=options_server.base_url, timeout=120) as c:
        yield c


def test_config_file_and_command_line_override(http: httpx.Client) -> None:
    names = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert names == ["opts"]


def test_root_path(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert http.post("/llm/v1/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json=body).status_code == 200  # a stripping proxy
    assert http.get("/llm/health").status_code == 200
    assert http.post("/other/v1/completions", json=body).status_code == 404


def test_invocations_route_by_body(http: httpx.Client) -> None:
    chat = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = http.post("/llm/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    neither = http.post("/invocations", json={"input": "Hi"})
    assert neither.status_code == 400
    bad = http.post("/invocations", json={"prompt": "Hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_chat_batch(http: httpx.Client) -> None:
    conversations = [MESSAGES, [{"role": "user", "content": "Count to three."}]]
    body = {"messages": conversations, "max_tokens": 4, "temperature": 0}
    r = http.post("/v1/chat/completions/batch", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    tokens = 0
    for i, conversation in enumerate(conversations):
        one = http.post("/v1/chat/completions", json={**body, "messages": conversation}).json()
        assert out["choices"][i]["message"] == one["choices"][0]["message"]
        tokens += one["usage"]["completion_tokens"]
    assert out["usage"]["completion_tokens"] == tokens
    streamed = http.post("/v1/chat/completions/batch", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_load_counts_running_requests(http: httpx.Client) -> None:
    assert http.get("/load").json() == {"server_load": 0}
    seen: list[int] = []
    body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for _ in response.iter_lines():
            if not seen:
                seen.append(http.get("/load").json()["server_load"])
    assert seen == [1]
    # The count drops when the server's handler returns, a moment after the client has read
    # the last event.
    deadline = time.monotonic() + 5
    while http.get("/load").json()["server_load"] != 0:
        assert time.monotonic() < deadline, "server_load stayed above 0 after the stream ended"
        time.sleep(0.01)


def test_forced_usage_and_metrics(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "stream": True}
    events = sse_events(http.post("/v1/completions", json=body).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks)  # no stream_options: usage anyway
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4
    assert final["metrics"]["queue_time_ms"] >= 0 and final["metrics"]["tokens_per_second"] > 0
    full = http.post("/v1/completions", json={**body, "stream": False}).json()
    metrics = full["metrics"]
    assert set(metrics) >= {"time_to_first_token_ms", "generation_time_ms", "mean_itl_ms"}
    assert metrics["generation_time_ms"] >= 0
    assert (
        http.post("/v1/completions", json={**body, "stream": False, "n": 2}).json()["metrics"]
        is None
    )  # not one sequence's


def test_token_ids_in_logprobs_by_default(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 1}
    tokens = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    off = {**body, "return_tokens_as_token_ids": False}
    tokens = http.post("/v1/completions", json=off).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in tokens)


def test_max_logprobs_minus_one_is_the_vocabulary(http: httpx.Client, tokenizer: Any) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["choices"][0]["logprobs"]["content"]
    assert len(entry["top_logprobs"]) == tokenizer.vocab_size
    bad = http.post("/v1/chat/completions", json={**body, "top_logprobs": -2})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "top_logprobs"
    assert "greater_than_equal" in bad.json()["error"]["message"]


def test_chat_template_and_generation_config(http: httpx.Client, tokenizer: Any) -> None:
    body = {"messages": MESSAGES, "return_token_ids": True, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body).json()
    prompt = tokenizer.decode(r["prompt_token_ids"], skip_special_tokens=False)
    assert prompt == "<<Name a colour.>>"
    # The folder's max_new_tokens is the default length; a request's own still wins.
    assert r["usage"]["completion_tokens"] <= 3
    longer = http.post("/v1/chat/completions", json={**body, "max_tokens": 6, "ignore_eos": True})
    assert longer.json()["usage"]["completion_tokens"] == 6


def test_cors(http: httpx.Client) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    ok = http.options("/v1/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/completions", headers={**preflight, "Origin": "https://x.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_request_id_header(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                  headers={"X-Request-Id": "abc-123"})  # fmt: skip
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    fresh = http.get("/health").headers["x-request-id"]
    assert len(fresh) == 32 and fresh != http.get("/health").headers["x-request-id"]


def test_load_is_zero_when_untracked(client: httpx.Client) -> None:
    # The shared server does not track load: vLLM answers 0 there too, mid-stream included.
    body = {"prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True, "stream": True}
    loads = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        for _ in response.iter_lines():
            loads.append(client.get("/load").json()["server_load"])
    assert loads and set(loads) == {0}


def test_yaml_config_expansion(tmp_path: Path) -> None:
    from asyncserve.cli import build_parser, main

    (tmp_path / "c.yaml").write_text(
        "port: 9001\nenable-prefix-caching: false\nserved_model_name: [a, b]\n"
        "allowed-origins: ['https://a.example']\nmax-log-len: 7\n"
    )
    from asyncserve.cli_server import expand_config_file

    parser = build_parser()
    argv = expand_config_file(
        ["serve", "--config", str(tmp_path / "c.yaml"), "--port", "9002"],
        parser.get_default("serve_parser"),
    )
    args = parser.parse_args(argv)
    assert args.port == 9002 and args.max_log_len == 7  # the command line wins
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.allowed_origins == ["https://a.example"]
    (tmp_path / "bad.yaml").write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "bad.yaml")])


def test_auto_tool_choice_parses_the_models_calls(
    http: httpx.Client, options_server: ServerProcess
) -> None:
    """The model's output is held (by a regex) to a Hermes tool call; the server reads it
    back as an OpenAI tool call, whole and streamed."""
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{options_server.base_url}/v1", api_key="x", max_retries=0)
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    regex = r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}</tool_call>'
    kwargs: dict[str, Any] = dict(
        model="opts",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    done = oai.chat.completions.create(**kwargs).choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content == "Checking."
    [call] = done.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    with oai.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking."
    [again] = streamed.message.tool_calls
    assert (again.function.name, again.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
