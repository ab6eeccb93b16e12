"""Prometheus collectors with vLLM's metric names, prefixed `asyncserve:` and, at /metrics,
also `vllm:` (--metrics-prefix), so that dashboards built for vLLM read them unchanged.

The engine calls the `on_*` hooks; the server renders the registry at /metrics. Every instance
owns its registry (no module-level state), so several engines or tests never collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "asyncserve:"
VLLM_PREFIX = "vllm:"
# --metrics-prefix: which names /metrics shows the series under.
METRICS_PREFIXES = ("both", "vllm", "asyncserve")
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's reasons a request waits: for room in the batch or KV cache ("capacity"), or for
# something else first, such as a grammar or a remote KV transfer ("deferred"). asyncserve
# compiles grammars before queueing, so nothing waits deferred.
WAITING_REASONS = ("capacity", "deferred")
ITERATION_TOKEN_BUCKETS: Sequence[float] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip

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


class ServerMetrics(Protocol):
    """What the server's /metrics route calls: bring the series up to date, then render."""

    async def refresh(self, engine: Any) -> None: ...

    def render(self, prefix: str = "both") -> tuple[bytes, str]: ...


def token_count_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to max_model_len: 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class _Renamed(Collector):
    """Every family of `source` again under another prefix (the same values, read at
    scrape time: nothing is counted twice)."""

    def __init__(self, source: CollectorRegistry, old: str, new: str) -> None:
        self.source, self.old, self.new = source, old, new

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            renamed = Metric(self._name(family.name), family.documentation, family.type)
            renamed.samples = [s._replace(name=self._name(s.name)) for s in family.samples]
            yield renamed

    def _name(self, name: str) -> str:
        return self.new + name[len(self.old) :] if name.startswith(self.old) else name


class EngineMetrics:
    """Engine-level gauges, counters and histograms, labelled with the served model name."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 2**20,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._vllm_names = vllm_names(self.registry)
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
        tokens = token_count_buckets(max_model_len)
        self._request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", tokens
        )
        self._request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", tokens
        )
        self._iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS
        )
        self._waiting_by_reason = Gauge(
            PREFIX + "num_requests_waiting_by_reason",
            "Requests waiting to be scheduled, by why they wait.",
            ["model_name", "reason"],
            registry=reg,
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )

        # vLLM's LoRA info: one series whose labels name the adapters in use, its value the
        # time they last changed.
        self._lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        self._lora_labels: tuple[str, str, str] | None = None
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
        self._request_prompt_tokens_c = self._request_prompt_tokens.labels(name)
        self._request_generation_tokens_c = self._request_generation_tokens.labels(name)
        self._iteration_tokens_c = self._iteration_tokens.labels(name)
        self._waiting_capacity_c = self._waiting_by_reason.labels(name, "capacity")
        self._waiting_by_reason.labels(name, "deferred").set(0)

    def on_step(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self._running_c.set(num_running)
        self._waiting_c.set(num_waiting)
        self._waiting_capacity_c.set(num_waiting)
        self._kv_usage_c.set(kv_cache_usage)

    def on_lora(self, max_lora: int, running: Sequence[str], waiting: Sequence[str]) -> None:
        """The adapters of running and waiting requests (comma-separated names, as vLLM)."""
        labels = (str(max_lora), ",".join(waiting), ",".join(running))
        if labels == self._lora_labels:
            return
        self._lora_info.clear()
        self._lora_info.labels(*labels).set(time.time())
        self._lora_labels = labels

    def on_iteration(self, num_tokens: int) -> None:
        """One engine step that scheduled `num_tokens` tokens (prompt and output)."""
        if num_tokens > 0:
            self._iteration_tokens_c.observe(num_tokens)

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

    def on_request_finished(
        self,
        finish_reason: str,
        e2e_s: float,
        queue_s: float,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
    ) -> None:
        child = self._success_c.get(finish_reason)
        if child is None:
            child = self._success_c[finish_reason] = self._success.labels(
                self.model_name, finish_reason
            )
        child.inc()
        self._e2e_c.observe(e2e_s)
        self._queue_c.observe(queue_s)
        if prompt_tokens is not None:
            self._request_prompt_tokens_c.observe(prompt_tokens)
        if generation_tokens is not None:
            self._request_generation_tokens_c.observe(generation_tokens)

    async def refresh(self, engine: Any) -> None:
        """Gauges as of now, not as of the last step (an idle engine does not step)."""
        self.on_step(engine.num_running, engine.num_waiting, engine.kv_cache_usage)

    def render(self, prefix: str = "both") -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type; `prefix` (one of
        METRICS_PREFIXES) picks the names: asyncserve:, vllm:, or both."""
        return render_registry(self.registry, self._vllm_names, prefix)


def vllm_names(registry: CollectorRegistry) -> CollectorRegistry:
    """The same series under vLLM's `vllm:` names, read from `registry` at scrape time."""
    renamed = CollectorRegistry(auto_describe=False)
    renamed.register(_Renamed(registry, PREFIX, VLLM_PREFIX))
    return renamed


def render_registry(
    registry: CollectorRegistry, renamed: CollectorRegistry, prefix: str
) -> tuple[bytes, str]:
    if prefix not in METRICS_PREFIXES:
        raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
    parts = []
    if prefix in ("both", "asyncserve"):
        parts.append(generate_latest(registry))
    if prefix in ("both", "vllm"):
        parts.append(generate_latest(renamed))
    return b"".join(parts), CONTENT_TYPE_LATEST
