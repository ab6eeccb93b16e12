"""The Ray backend's engine arguments: the serve flags and LLM(...) names map to
ParallelConfig, bad values fail with the name of the argument (no Ray started)."""

from __future__ import annotations

import pytest

from asyncserve.cli import build_parser, engine_config_from_args
from asyncserve.config import EngineConfig, Environment, ParallelConfig

NO_ENV = Environment(api_key=None, default_model=None, log_level="INFO")


def test_serve_flags_map_to_parallel_config() -> None:
    args = build_parser().parse_args(
        ["serve", "-tp", "4", "--distributed-executor-backend", "ray"]
        + ["--ray-placement-strategy", "SPREAD"]
    )
    parallel = engine_config_from_args(args, NO_ENV).parallel
    assert parallel == ParallelConfig(
        tensor_parallel_size=4, distributed_executor_backend="ray", ray_placement_strategy="SPREAD"
    )
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]), NO_ENV).parallel
    assert defaults.distributed_executor_backend is None
    assert defaults.ray_placement_strategy == "STRICT_PACK"


def test_bad_values_name_the_argument() -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        EngineConfig.from_engine_args(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="ray_placement_strategy must be one of"):
        EngineConfig.from_engine_args(ray_placement_strategy="RANDOM")
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        EngineConfig.from_engine_args(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "slurm"])
