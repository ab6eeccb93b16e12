"""Arguments of the wrong type: LLM(...) and from_engine_args name the argument and the type
it takes in a one-line ValueError before anything loads; the config sections check their fields."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from asyncserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from asyncserve.llm import LLM

BAD_ARGUMENTS = [
    ({"max_model_len": "abc"}, "max_model_len must be an int or None, got 'abc' (str)"),
    ({"max_model_len": 512.0}, "max_model_len must be an int or None"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be a number, got '0.9'"),
    ({"gpu_memory_utilization": True}, "gpu_memory_utilization must be a number"),
    ({"tensor_parallel_size": 1.5}, "tensor_parallel_size must be an int, got 1.5 (float)"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size must be an int"),
    ({"enforce_eager": "yes"}, "enforce_eager must be a bool, got 'yes' (str)"),
    ({"enforce_eager": 1}, "enforce_eager must be a bool, got 1 (int)"),
    ({"enable_prefix_caching": 0}, "enable_prefix_caching must be a bool"),
    ({"async_scheduling": "false"}, "async_scheduling must be a bool or None"),
    ({"max_num_seqs": "8"}, "max_num_seqs must be an int"),
    ({"num_gpu_blocks_override": 8.0}, "num_gpu_blocks_override must be an int or None"),
    ({"seed": None}, "seed must be an int, got None"),
    ({"device": 0}, "device must be a string, got 0 (int)"),
    ({"dtype": None}, "dtype must be a string"),
    ({"scheduling_policy": 1}, "scheduling_policy must be a string"),
    ({"kv_cache_dtype": b"fp8"}, "kv_cache_dtype must be a string"),
    ({"model": 7}, "model must be a string or a PathLike or None"),
    ({"max_logprobs": "20"}, "max_logprobs must be an int"),
]


@pytest.fixture()
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an engine was built")

    for name in ("AsyncEngine", "PoolingEngine", "DataParallelClient"):
        monkeypatch.setattr(f"asyncserve.llm.{name}.from_config", refuse, raising=False)
    monkeypatch.setattr("asyncserve.llm.DataParallelClient.__init__", refuse)


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGUMENTS)
@pytest.mark.usefixtures("no_loading")
def test_llm_argument_of_the_wrong_type_is_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        LLM(**{"device": "cpu", **kwargs})
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text, text


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGUMENTS[:-1])
def test_engine_argument_of_the_wrong_type_is_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        EngineConfig.from_engine_args(**kwargs)


def test_right_types_still_pass(tmp_path: Path) -> None:
    config = EngineConfig.from_engine_args(
        tmp_path / "model.gguf",
        gpu_memory_utilization=1,  # a float argument takes an int
        decode_latency_target_ms=0,
        async_scheduling=None,
        enforce_eager=True,
        allowed_media_domains="example.com",
        limit_mm_per_prompt={"image": 2},
        kv_transfer_config={"kv_connector": "TCPConnector", "kv_role": "kv_producer"},
        speculative_config=None,
    )
    assert config.model.model == str(tmp_path / "model.gguf")
    assert config.cache.gpu_memory_utilization == 1 and not config.enable_cuda_graphs
    assert config.multimodal.allowed_media_domains == ("example.com",)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(max_model_len="abc"), "max_model_len must be an int or None"),
        (lambda: ModelConfig(load_format=3), "load_format must be a string, got 3"),
        (lambda: CacheConfig(enable_prefix_caching=1), "enable_prefix_caching must be a bool"),
        (lambda: CacheConfig(num_blocks_override=2.0), "num_blocks_override must be an int"),
        (lambda: SchedulerConfig(max_num_seqs=True), "max_num_seqs must be an int"),
        (lambda: ParallelConfig(tensor_parallel_size=2.0), "tensor_parallel_size must be an int"),
        (lambda: LoRAConfig(max_lora_rank="16"), "max_lora_rank must be an int"),
        (lambda: KVTransferConfig.from_dict({"kv_port": "80"}), "kv_port must be an int or None"),
        (
            lambda: KVTransferConfig(kv_producer_urls=("http://a", 5)),
            "kv_producer_urls must be a tuple",
        ),
        (lambda: EngineConfig(stream_interval="1"), "stream_interval must be an int"),
        (lambda: EngineConfig(cache=ModelConfig()), "cache must be a CacheConfig"),
    ],
)
def test_config_field_of_the_wrong_type_is_named(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build()
