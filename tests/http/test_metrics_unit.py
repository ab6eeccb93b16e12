"""EngineMetrics: vLLM names with the asyncserve: prefix, own registry, values as reported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asyncserve.metrics import EngineMetrics


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_names_labels_and_values() -> None:
    m = EngineMetrics("smol")
    m.on_step(num_running=3, num_waiting=2, kv_cache_usage=0.25)
    m.on_preemptions(2)
    m.on_prefix_cache(queries=100, hits=64)
    m.on_tokens(prompt_tokens=10, generation_tokens=5)
    m.on_first_token(0.03)
    m.on_inter_token(0.02)
    m.on_inter_token(0.04)
    m.on_request_finished("stop", e2e_s=1.2, queue_s=0.01)
    m.on_request_finished("length", e2e_s=2.0, queue_s=0.02)
    m.on_request_finished("length", e2e_s=2.0, queue_s=0.02)
    s = _samples(m)
    label = (("model_name", "smol"),)
    assert s[("asyncserve:num_requests_running", label)] == 3
    assert s[("asyncserve:num_requests_waiting", label)] == 2
    assert s[("asyncserve:kv_cache_usage_perc", label)] == 0.25
    assert s[("asyncserve:num_preemptions_total", label)] == 2
    assert s[("asyncserve:prefix_cache_queries_total", label)] == 100
    assert s[("asyncserve:prefix_cache_hits_total", label)] == 64
    assert s[("asyncserve:prompt_tokens_total", label)] == 10
    assert s[("asyncserve:generation_tokens_total", label)] == 5
    assert s[("asyncserve:time_to_first_token_seconds_count", label)] == 1
    assert s[("asyncserve:inter_token_latency_seconds_count", label)] == 2
    assert abs(s[("asyncserve:inter_token_latency_seconds_sum", label)] - 0.06) < 1e-9
    assert s[("asyncserve:e2e_request_latency_seconds_count", label)] == 3
    assert s[("asyncserve:request_queue_time_seconds_count", label)] == 3

    def success(reason: str) -> float:
        key = tuple(sorted({"model_name": "smol", "finished_reason": reason}.items()))
        return s[("asyncserve:request_success_total", key)]

    assert success("stop") == 1
    assert success("length") == 2
    assert success("abort") == 0  # pre-created, so dashboards see a zero series


def test_registries_are_independent() -> None:
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.on_tokens(0, 7)
    assert ("asyncserve:generation_tokens_total", (("model_name", "a"),)) in _samples(a)
    sb = _samples(b)
    assert sb[("asyncserve:generation_tokens_total", (("model_name", "b"),))] == 0
    assert not any(labels == (("model_name", "a"),) for _, labels in sb)


def test_unknown_finish_reason_gets_its_own_series() -> None:
    m = EngineMetrics("m")
    m.on_request_finished("timeout", 1.0, 0.0)
    key = tuple(sorted({"model_name": "m", "finished_reason": "timeout"}.items()))
    assert _samples(m)[("asyncserve:request_success_total", key)] == 1


def test_vllm_histograms_and_names() -> None:
    m = EngineMetrics("smol", max_model_len=100)
    m.on_step(num_running=1, num_waiting=4, kv_cache_usage=0.5)
    m.on_iteration(48)
    m.on_iteration(0)  # an empty step is not an iteration
    m.on_request_finished("stop", e2e_s=1.0, queue_s=0.1, prompt_tokens=7, generation_tokens=30)
    s = _samples(m)
    label = (("model_name", "smol"),)
    for prefix in ("asyncserve:", "vllm:"):
        assert s[(prefix + "request_prompt_tokens_sum", label)] == 7
        assert s[(prefix + "request_generation_tokens_sum", label)] == 30
        assert s[(prefix + "iteration_tokens_total_count", label)] == 1
        # 1-2-5 buckets up to max_model_len, as vLLM's.
        le = (("le", "50.0"), ("model_name", "smol"))
        assert s[(prefix + "request_generation_tokens_bucket", le)] == 1
        assert (prefix + "request_prompt_tokens_bucket", (("le", "200.0"), label[0])) not in s
        for reason, count in (("capacity", 4), ("deferred", 0)):
            key = tuple(sorted({"model_name": "smol", "reason": reason}.items()))
            assert s[(prefix + "num_requests_waiting_by_reason", key)] == count
    only_vllm = m.render("vllm")[0].decode()
    assert "vllm:num_requests_waiting{" in only_vllm and "asyncserve:" not in only_vllm
    only_ours = m.render("asyncserve")[0].decode()
    assert "asyncserve:num_requests_waiting{" in only_ours and "vllm:" not in only_ours
