"""/health, /metrics, /version, /openapi.json, and the API key on every other route."""

from __future__ import annotations

import time

import httpx
import pytest

from asyncserve import __version__
from tests.http.conftest import API_KEY, MODEL, ServerProcess

pytestmark = pytest.mark.timeout(300)

METRIC_NAMES = [
    "asyncserve:num_requests_running",
    "asyncserve:num_requests_waiting",
    "asyncserve:kv_cache_usage_perc",
    "asyncserve:num_preemptions_total",
    "asyncserve:prompt_tokens_total",
    "asyncserve:generation_tokens_total",
    "asyncserve:time_to_first_token_seconds_bucket",
    "asyncserve:inter_token_latency_seconds_bucket",
    "asyncserve:e2e_request_latency_seconds_bucket",
    "asyncserve:request_queue_time_seconds_bucket",
    "asyncserve:prefix_cache_queries_total",
    "asyncserve:prefix_cache_hits_total",
    "asyncserve:request_success_total",
    "asyncserve:request_prompt_tokens_bucket",
    "asyncserve:request_generation_tokens_bucket",
    "asyncserve:iteration_tokens_total_bucket",
    "asyncserve:num_requests_waiting_by_reason",
]


def test_health(client: httpx.Client) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["num_total_blocks"] > 0
    assert 0 <= body["num_free_blocks"] <= body["num_total_blocks"]


def test_metrics_count_a_request(client: httpx.Client) -> None:
    def value(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    before = client.get("/metrics").text
    out = client.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 5, "ignore_eos": True},
    )
    assert out.status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = response.text
    for name in METRIC_NAMES:
        assert f"{name}{{" in after, name
    assert f'model_name="{MODEL}"' in after
    assert 'finished_reason="length"' in after
    generated = value(after, "asyncserve:generation_tokens_total") - value(
        before, "asyncserve:generation_tokens_total"
    )
    assert generated == 5
    prompt = value(after, "asyncserve:prompt_tokens_total") - value(
        before, "asyncserve:prompt_tokens_total"
    )
    assert prompt == 5
    ttft = value(after, "asyncserve:time_to_first_token_seconds_count") - value(
        before, "asyncserve:time_to_first_token_seconds_count"
    )
    assert ttft == 1
    # The same series under vLLM's names (--metrics-prefix both, the default).
    for name in METRIC_NAMES:
        vllm_name = name.replace("asyncserve:", "vllm:")
        assert f"{vllm_name}{{" in after, vllm_name
    for name in ("generation_tokens_total", "request_generation_tokens_sum"):
        assert value(after, "vllm:" + name) == value(after, "asyncserve:" + name)
    assert 'vllm:num_requests_waiting_by_reason{model_name="smol",reason="capacity"}' in after


def test_version(client: httpx.Client) -> None:
    assert client.get("/version").json() == {"version": __version__}


def test_openapi_describes_endpoints_and_bodies(client: httpx.Client) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    paths = spec["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/")
        assert "400" in paths[path]["post"]["responses"]
    for path in ("/v1/models", "/health", "/version", "/metrics"):
        assert "get" in paths[path]
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    for field in ("temperature", "top_p", "top_k", "logprobs", "top_logprobs", "stream_options",
                  "max_completion_tokens", "continue_final_message"):  # fmt: skip
        assert field in chat["properties"], field
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"

    # The schema accepts a good body and rejects a badly typed one.
    resolver_doc = {"components": spec["components"], **schemas["ChatCompletionRequest"]}
    validator = jsonschema.Draft202012Validator(resolver_doc)
    validator.validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"messages": "hi"})


ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/generate"),
    ("GET", "/version"),
    ("GET", "/openapi.json"),
    ("GET", "/no-such-route"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"X-Api-Key": API_KEY}],
    ids=["none", "wrong", "no-bearer", "other-header"],
)
def test_api_key_required(
    server: ServerProcess, method: str, path: str, headers: dict[str, str]
) -> None:
    response = httpx.request(method, server.base_url + path, headers=headers, json={})
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "AuthenticationError"
    assert response.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_are_open(server: ServerProcess) -> None:
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200
    for method in ("GET", "POST"):  # vLLM's /ping, SageMaker's health check
        ping = httpx.request(method, server.base_url + "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "ok"
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_right_key_passes(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.get(server.base_url + "/v1/models", headers=headers)
    assert response.status_code == 200
    response = httpx.post(
        server.base_url + "/v1/completions",
        headers=headers,
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_request_log_and_access_log_filters(server: ServerProcess, client: httpx.Client) -> None:
    marker = "zebra-quartz-1234567890-" + "tail-that-must-not-be-logged"
    assert (
        client.post("/v1/completions", json={"prompt": marker, "max_tokens": 1}).status_code == 200
    )
    client.get("/health")
    client.get("/metrics")
    client.get("/v1/models")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and '"GET /v1/models' not in server.logs():
        time.sleep(0.1)
    logs = server.logs()
    assert '"GET /v1/models HTTP/1.1" 200' in logs  # the access log is on...
    assert "GET /health" not in logs and "GET /metrics" not in logs  # ...but not for these
    assert repr(marker[:24]) in logs  # --enable-log-requests, cut at --max-log-len
    assert "tail-that-must-not-be-logged" not in logs
