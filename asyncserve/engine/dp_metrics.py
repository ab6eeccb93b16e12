"""/metrics of a data-parallel server: every replica's series labelled `engine="<index>"`
(as vLLM labels them), and `engine="total"` series over the live replicas (sums; the mean
for the KV-cache usage fraction), gathered from the replicas at each scrape."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from asyncserve.metrics import render_registry, vllm_names

# Gauges whose total is the mean over replicas rather than the sum.
_MEAN_GAUGES = frozenset({"asyncserve:kv_cache_usage_perc"})


def merge_families(snapshots: dict[int, list[Metric]]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for index in sorted(snapshots):
        for family in snapshots[index]:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                totals[family.name] = defaultdict(list)
            for sample in family.samples:
                out.add_sample(sample.name, {**sample.labels, "engine": str(index)}, sample.value)
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals[family.name][key].append(sample.value)
    for name, series in totals.items():
        family = merged[name]
        for (sample_name, labels), values in series.items():
            if sample_name.endswith("_created"):
                value = min(values)
            elif name in _MEAN_GAUGES:
                value = sum(values) / len(values)
            else:
                value = sum(values)
            family.add_sample(sample_name, {**dict(labels), "engine": "total"}, value)
    return list(merged.values())


class _Snapshots(Collector):
    def __init__(self) -> None:
        self.snapshots: dict[int, list[Metric]] = {}

    def collect(self) -> Iterator[Metric]:
        yield from merge_families(self.snapshots)


class DataParallelMetrics:
    """What the server's /metrics route needs (asyncserve.metrics.ServerMetrics)."""

    def __init__(self) -> None:
        self._collector = _Snapshots()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._collector)
        self._vllm_names = vllm_names(self.registry)

    async def refresh(self, engine: Any) -> None:
        # `engine` is the DataParallelClient the server runs.
        self._collector.snapshots = await engine.metrics_snapshots()

    def render(self, prefix: str = "both") -> tuple[bytes, str]:
        return render_registry(self.registry, self._vllm_names, prefix)
