"""The environment variables the project reads, read once (here and in engine.py's
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL only)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelRank:
    """This process's place among data-parallel ranks started by a launcher (one LLM per
    rank, vLLM's SPMD pattern): ASYNCSERVE_DP_RANK / _SIZE / _MASTER_IP / _MASTER_PORT."""

    rank: int
    size: int
    master_ip: str
    master_port: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"ASYNCSERVE_DP_SIZE must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ASYNCSERVE_DP_RANK must be in [0, {self.size}), got {self.rank}")
        if not 0 < self.master_port <= 65535:
            raise ValueError(
                f"ASYNCSERVE_DP_MASTER_PORT must be in [1, 65535], got {self.master_port}"
            )


def _env_int(name: str, default: str) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _read_dp_rank() -> DataParallelRank | None:
    if "ASYNCSERVE_DP_RANK" not in os.environ and "ASYNCSERVE_DP_SIZE" not in os.environ:
        return None
    return DataParallelRank(
        rank=_env_int("ASYNCSERVE_DP_RANK", "0"),
        size=_env_int("ASYNCSERVE_DP_SIZE", "1"),
        master_ip=os.environ.get("ASYNCSERVE_DP_MASTER_IP", "127.0.0.1"),
        master_port=_env_int("ASYNCSERVE_DP_MASTER_PORT", "29500"),
    )


def image_fetch_timeout_s() -> float | None:
    """ASYNCSERVE_IMAGE_FETCH_TIMEOUT (vLLM: VLLM_IMAGE_FETCH_TIMEOUT): seconds one media URL
    fetch may take; None when unset."""
    text = os.environ.get("ASYNCSERVE_IMAGE_FETCH_TIMEOUT")
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"ASYNCSERVE_IMAGE_FETCH_TIMEOUT must be a number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"ASYNCSERVE_IMAGE_FETCH_TIMEOUT must be > 0, got {text!r}")
    return value


def _read_visible_devices() -> tuple[str, ...] | None:
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not text:
        return None
    return tuple(d.strip() for d in text.split(",") if d.strip())


@dataclass(frozen=True)
class Environment:
    """Environment variables the project reads, read once."""

    api_key: str | None
    default_model: str | None
    log_level: str
    # The runtime /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints (vLLM reads
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING for the same switch).
    allow_runtime_lora_updating: bool = False
    # Set by a data-parallel launcher (examples/data_parallel.py); None otherwise.
    dp_rank: DataParallelRank | None = None
    # The CUDA devices this process may use (data-parallel replicas split them); None: all.
    cuda_visible_devices: tuple[str, ...] | None = None

    @classmethod
    def read(cls) -> Environment:
        return cls(
            api_key=os.environ.get("ASYNCSERVE_API_KEY") or None,
            default_model=os.environ.get("ASYNCSERVE_MODEL") or None,
            log_level=os.environ.get("ASYNCSERVE_LOG_LEVEL", "INFO"),
            allow_runtime_lora_updating=os.environ.get(
                "ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING", ""
            ).lower()
            in ("1", "true"),
            dp_rank=_read_dp_rank(),
            cuda_visible_devices=_read_visible_devices(),
        )
