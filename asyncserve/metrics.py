"""Prometheus collectors with vLLM's metric names, prefixed `asyncserve:`.

The engine calls the `on_*` hooks; the server renders the registry at /metrics. Every instance
owns its registry (no module-level state), so several engines or tests never collide.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "asyncserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Buckets as vLLM uses them, so dashboards built for vLLM read these the same way.
TTFT_BUCKETS: Sequence[float] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Sequence[float] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Sequence[float] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EngineMetrics:
    """Engine-level gauges, counters and histograms, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self._running = gauge("num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 means 100 percent)."
        )
        self._preemptions = counter("num_preemptions", "Preemptions (recompute) so far.")
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self._generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to first output token.", TTFT_BUCKETS
        )
        self._itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )

        # Speculative decoding, as vLLM names it (registered even when off, then zero).
        self._spec_drafts = counter("spec_decode_num_drafts", "Verification rounds with proposals.")
        self._spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens.")
        self._spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens the target accepted."
        )
        self._spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens at each position (0-based).",
            ["model_name", "position"],
            registry=reg,
        )

        # Bind the label once: the hooks run on the step loop, per token.
        name = model_name
        self._running_c = self._running.labels(name)
        self._waiting_c = self._waiting.labels(name)
        self._kv_usage_c = self._kv_usage.labels(name)
        self._preemptions_c = self._preemptions.labels(name)
        self._prompt_tokens_c = self._prompt_tokens.labels(name)
        self._generation_tokens_c = self._generation_tokens.labels(name)
        self._prefix_queries_c = self._prefix_queries.labels(name)
        self._prefix_hits_c = self._prefix_hits.labels(name)
        self._ttft_c = self._ttft.labels(name)
        self._itl_c = self._itl.labels(name)
        self._e2e_c = self._e2e.labels(name)
        self._queue_c = self._queue.labels(name)
        self._success_c = {r: self._success.labels(name, r) for r in FINISH_REASONS}

    def on_step(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self._running_c.set(num_running)
        self._waiting_c.set(num_waiting)
        self._kv_usage_c.set(kv_cache_usage)

    def on_preemptions(self, count: int) -> None:
        if count > 0:
            self._preemptions_c.inc(count)

    def on_prefix_cache(self, queries: int, hits: int) -> None:
        if queries > 0:
            self._prefix_queries_c.inc(queries)
        if hits > 0:
            self._prefix_hits_c.inc(hits)

    def on_spec_decode(
        self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: Sequence[int]
    ) -> None:
        if drafts > 0:
            self._spec_drafts.labels(self.model_name).inc(drafts)
        if draft_tokens > 0:
            self._spec_draft_tokens.labels(self.model_name).inc(draft_tokens)
        if accepted > 0:
            self._spec_accepted.labels(self.model_name).inc(accepted)
        for pos, count in enumerate(accepted_per_pos):
            if count > 0:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(count)

    def on_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        if prompt_tokens > 0:
            self._prompt_tokens_c.inc(prompt_tokens)
        if generation_tokens > 0:
            self._generation_tokens_c.inc(generation_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft_c.observe(ttft_s)

    def on_inter_token(self, itl_s: float) -> None:
        self._itl_c.observe(itl_s)

    def on_request_finished(self, finish_reason: str, e2e_s: float, queue_s: float) -> None:
        child = self._success_c.get(finish_reason)
        if child is None:
            child = self._success_c[finish_reason] = self._success.labels(
                self.model_name, finish_reason
            )
        child.inc()
        self._e2e_c.observe(e2e_s)
        self._queue_c.observe(queue_s)

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
