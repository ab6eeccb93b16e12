"""OpenTelemetry traces: one span per request, with vLLM's attribute names.

Off unless `--otlp-traces-endpoint` is set; then the OpenTelemetry SDK (the `[otel]` extra)
exports spans in batches from its own thread. A request's span is made when it ends, from
the timestamps the engine keeps anyway, so tracing adds nothing to the step loop. A W3C
`traceparent` header on the HTTP request makes the span a child of the caller's trace.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncserve.config import ObservabilityConfig

# Headers that carry W3C trace context.
TRACE_HEADERS = ("traceparent", "tracestate")


class SpanAttributes:
    """Attribute names as vLLM sets them (the OpenTelemetry gen_ai conventions, plus vLLM's
    own latency breakdown), so trace queries written for vLLM work unchanged."""

    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace-context headers of an HTTP request, or None when it has none."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


@dataclass
class FinishedRequest:
    """What a span says of one request; times are time.monotonic() seconds."""

    request_id: str
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    completion_tokens: int
    num_sequences: int
    max_tokens: int | None
    temperature: float
    top_p: float
    # Summed wall time of the steps the request was in (detailed traces only).
    model_execute_s: float | None = None
    headers: Mapping[str, str] | None = None


class RequestTracer:
    """Makes and exports the spans. Built only when tracing is on: importing the SDK costs
    nothing for servers that never trace."""

    def __init__(self, config: ObservabilityConfig, model_name: str) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise ValueError(
                "--otlp-traces-endpoint needs OpenTelemetry: pip install 'asyncserve[otel]'"
            ) from exc
        assert config.otlp_traces_endpoint is not None
        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": "asyncserve"}))
        exporter = _span_exporter(config.otlp_traces_endpoint, config.otlp_traces_protocol)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("asyncserve")
        self.propagator = TraceContextTextMapPropagator()
        self.detailed = config.collect_detailed_traces is not None

    def record(self, done: FinishedRequest) -> None:
        from opentelemetry.trace import SpanKind

        context = self.propagator.extract(dict(done.headers)) if done.headers else None
        # Spans carry wall-clock nanoseconds; the engine keeps monotonic seconds.
        offset_ns = time.time_ns() - int(time.monotonic() * 1e9)

        def wall(t: float) -> int:
            return offset_ns + int(t * 1e9)

        span = self.tracer.start_span(
            "llm_request", context=context, kind=SpanKind.SERVER, start_time=wall(done.arrival)
        )
        a = SpanAttributes
        attrs: dict[str, Any] = {
            a.RESPONSE_MODEL: self.model_name,
            a.REQUEST_ID: done.request_id,
            a.REQUEST_TEMPERATURE: done.temperature,
            a.REQUEST_TOP_P: done.top_p,
            a.REQUEST_N: done.num_sequences,
            a.USAGE_NUM_SEQUENCES: done.num_sequences,
            a.USAGE_PROMPT_TOKENS: done.prompt_tokens,
            a.USAGE_COMPLETION_TOKENS: done.completion_tokens,
            a.LATENCY_E2E: done.finished - done.arrival,
        }
        if done.max_tokens is not None:
            attrs[a.REQUEST_MAX_TOKENS] = done.max_tokens
        if done.first_scheduled is not None:
            attrs[a.LATENCY_TIME_IN_QUEUE] = done.first_scheduled - done.arrival
            attrs[a.LATENCY_TIME_IN_MODEL_INFERENCE] = done.finished - done.first_scheduled
        if done.first_token is not None:
            attrs[a.LATENCY_TIME_TO_FIRST_TOKEN] = done.first_token - done.arrival
            attrs[a.LATENCY_TIME_IN_MODEL_DECODE] = done.finished - done.first_token
            if done.first_scheduled is not None:
                attrs[a.LATENCY_TIME_IN_MODEL_PREFILL] = done.first_token - done.first_scheduled
        if done.model_execute_s is not None:
            attrs[a.LATENCY_TIME_IN_MODEL_EXECUTE] = done.model_execute_s
        span.set_attributes(attrs)
        span.end(end_time=wall(done.finished))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export the spans queued so far (a server stopping should not lose them)."""
        self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter thread."""
        self.provider.shutdown()


def _span_exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError(
                "OTLP over gRPC needs the gRPC exporter: pip install 'asyncserve[otel]' "
                "(or set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)"
            ) from exc
        insecure = endpoint.startswith("http://")
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        # The HTTP exporter posts to the URL as given; a bare host:port gets OTLP's path.
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else _http_url(endpoint)
        return HTTPSpanExporter(endpoint=url)
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', got {protocol!r}"
    )


def _http_url(endpoint: str) -> str:
    base = endpoint if "://" in endpoint else "http://" + endpoint
    return base.rstrip("/") + "/v1/traces"
