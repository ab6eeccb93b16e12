"""OpenTelemetry request spans, received by an in-process OTLP collector: offline over gRPC
(the default protocol) and from the server over HTTP, with the caller's traceparent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncserve.config import ObservabilityConfig
from tests.http.conftest import ServerProcess, require_model
from tests.otlp_receiver import GRPCReceiver, HTTPReceiver, attributes

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def test_offline_spans_over_grpc(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncserve import LLM, SamplingParams

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export at once, not every 5 s
    receiver = GRPCReceiver()
    llm = LLM(
        device="cpu",
        max_model_len=256,
        kv_cache_memory=16 << 20,
        otlp_traces_endpoint=receiver.endpoint,
        collect_detailed_traces="model",
    )
    try:
        prompts = ["The capital of France is", "One, two, three,"]
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9))
        spans = receiver.wait_for(2)
    finally:
        llm.close()
        receiver.close()
    assert {s.name for s in spans} == {"llm_request"}
    by_id = {attributes(s)["gen_ai.request.id"]: attributes(s) for s in spans}
    assert len(by_id) == 2
    prompt_lens = sorted(len(o.prompt_token_ids) for o in outs)
    assert sorted(a["gen_ai.usage.prompt_tokens"] for a in by_id.values()) == prompt_lens
    for attrs in by_id.values():
        assert attrs["gen_ai.usage.completion_tokens"] == 5
        assert attrs["gen_ai.request.max_tokens"] == 5
        assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
        assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert attrs["gen_ai.request.n"] == 1
        assert attrs["gen_ai.response.model"] == gguf_path.stem
        e2e = attrs["gen_ai.latency.e2e"]
        assert (
            0
            <= attrs["gen_ai.latency.time_in_queue"]
            <= attrs["gen_ai.latency.time_to_first_token"]
            <= e2e
        )
        assert attrs["gen_ai.latency.time_in_model_prefill"] >= 0
        assert attrs["gen_ai.latency.time_in_model_decode"] >= 0
        # Detailed traces: the request's steps took time, at most its whole life.
        assert 0 < attrs["gen_ai.latency.time_in_model_execute"] <= e2e


@pytest.fixture(scope="module")
def traced_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, HTTPReceiver]]:
    require_model()
    receiver = HTTPReceiver()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        server = ServerProcess(
            [
                "--max-model-len",
                "512",
                "--kv-cache-memory",
                "32M",
                "--served-model-name",
                "traced",
                "--otlp-traces-endpoint",
                receiver.endpoint,
            ],  # fmt: skip
            tmp_path_factory.mktemp("traced"),
        )
    try:
        server.wait_ready()
        yield server.base_url, receiver
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
        receiver.close()


def test_server_span_joins_the_callers_trace(traced_server: tuple[str, HTTPReceiver]) -> None:
    base_url, receiver = traced_server
    before = len(receiver.spans)
    body = {"model": "traced", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    traced = httpx.post(
        f"{base_url}/v1/chat/completions",
        json=body,
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
        timeout=120,
    )
    assert traced.status_code == 200, traced.text
    plain = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "traced", "prompt": "Hi", "max_tokens": 3},
        timeout=120,
    )
    assert plain.status_code == 200, plain.text
    spans = receiver.wait_for(before + 2)[before:]
    joined = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    assert len(joined) == 1, [s.trace_id.hex() for s in spans]
    child = joined[0]
    assert child.parent_span_id.hex() == PARENT_SPAN_ID
    attrs = attributes(child)
    usage = traced.json()["usage"]
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 4
    assert attrs["gen_ai.response.model"] == "traced"
    assert "gen_ai.latency.time_in_model_execute" not in attrs  # not asked for
    # Without a traceparent the span starts a trace of its own.
    (own,) = [s for s in spans if s is not child]
    assert own.parent_span_id == b""
    assert attributes(own)["gen_ai.usage.completion_tokens"] == 3


def test_bad_tracing_options_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="collect_detailed_traces needs otlp_traces_endpoint"):
        ObservabilityConfig(collect_detailed_traces="model")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        ObservabilityConfig(otlp_traces_endpoint="http://x:4317", otlp_traces_protocol="json")
    with pytest.raises(ValueError, match="collect_detailed_traces must be"):
        ObservabilityConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces="gpu")
