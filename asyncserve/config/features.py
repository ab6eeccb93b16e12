"""Optional engine features: disaggregated prefill, request traces, LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal
from urllib.parse import urlsplit

from asyncserve.config.typecheck import check_fields

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_CONNECTORS = ("TCPConnector", "P2pNcclConnector", "PyNcclConnector")
# Connectors whose payload travels over a torch.distributed group (disagg/kv_group.py).
KV_GROUP_CONNECTORS = ("P2pNcclConnector", "PyNcclConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill (asyncserve/disagg/): vLLM's --kv-transfer-config keys. A
    producer prefills and keeps the request's KV blocks for a consumer to pull; a consumer
    pulls them before it decodes. `kv_rank` / `kv_parallel_size` are taken as vLLM names
    them and describe the deployment; pulls go to the producer named in each request. The
    group connectors (KV_GROUP_CONNECTORS) move the blocks over a process group of the pair
    (ranks kv_rank, a TCPStore at kv_ip:kv_port), the control messages staying on HTTP."""

    kv_connector: str = "TCPConnector"
    kv_role: KVRole = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 2
    # Seconds a producer keeps a finished request's blocks for its consumer to pull.
    kv_export_timeout_s: float = 120.0
    kv_ip: str | None = None
    kv_port: int | None = None
    # "cuda": the group's payload stays on the GPU (NCCL); "cpu": it goes through gloo.
    kv_buffer_device: str = "cuda"
    # Seconds one group send or receive may take before that transfer fails.
    kv_group_timeout_s: float = 30.0
    # A consumer's producers (base URLs): a request naming any other remote_url is refused,
    # so a caller cannot aim the pull (and the API key it carries) elsewhere. Empty: any.
    kv_producer_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got {self.kv_role!r}"
            )
        if self.kv_parallel_size < 1:
            raise ValueError(f"kv_parallel_size must be >= 1, got {self.kv_parallel_size}")
        if self.kv_export_timeout_s <= 0:
            raise ValueError(f"kv_export_timeout_s must be > 0, got {self.kv_export_timeout_s}")
        if self.kv_buffer_device not in ("cuda", "cpu"):
            raise ValueError(f"kv_buffer_device must be 'cuda' or 'cpu', got "
                             f"{self.kv_buffer_device!r}")  # fmt: skip
        if self.uses_group:
            self._check_group()

    @property
    def uses_group(self) -> bool:
        return self.kv_connector in KV_GROUP_CONNECTORS

    def _check_group(self) -> None:
        name = f"kv_transfer_config: {self.kv_connector}"
        if not self.kv_ip or self.kv_port is None:
            raise ValueError(f"{name} needs kv_ip and kv_port (where rank 0 hosts the group's "
                             "store)")  # fmt: skip
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"{name}: kv_port must be in 1..65535, got {self.kv_port}")
        if self.kv_parallel_size != 2:
            raise ValueError(f"{name} pairs one producer with one consumer: kv_parallel_size "
                             f"must be 2, got {self.kv_parallel_size}")  # fmt: skip
        if self.kv_rank is None or not 0 <= self.kv_rank < self.kv_parallel_size:
            raise ValueError(f"{name}: kv_rank must be 0 or 1 (kv_parallel_size "
                             f"{self.kv_parallel_size}), got {self.kv_rank}")  # fmt: skip
        if self.kv_role == "kv_both":
            raise ValueError(f"{name}: kv_role must be kv_producer or kv_consumer (one sends, "
                             "the other receives); kv_both needs the TCPConnector")  # fmt: skip
        if self.kv_group_timeout_s <= 0:
            raise ValueError(f"kv_group_timeout_s must be > 0, got {self.kv_group_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        known = {f.name for f in fields(cls)}
        extra = raw.get("kv_connector_extra_config") or {}
        unknown = sorted(set(raw) - known - {"kv_connector_extra_config", "kv_buffer_size"})
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}")
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        args = {k: v for k, v in raw.items() if k in known}
        if "export_timeout_s" in extra:
            args["kv_export_timeout_s"] = float(extra["export_timeout_s"])
        if "transfer_timeout_s" in extra:
            args["kv_group_timeout_s"] = float(extra["transfer_timeout_s"])
        if "producer_urls" in extra:
            urls = extra["producer_urls"]
            if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
                raise ValueError("kv_transfer_config: kv_connector_extra_config.producer_urls "
                                 "must be a list of base URLs")  # fmt: skip
            for url in urls:
                parts = urlsplit(url)
                if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"kv_transfer_config: producer_urls: {url!r} is not an "
                                     "http(s) base URL")  # fmt: skip
            args["kv_producer_urls"] = tuple(urls)
        return cls(**args)


DetailedTraces = Literal["model", "worker", "all"]


@dataclass(frozen=True)
class ObservabilityConfig:
    """OpenTelemetry request traces (asyncserve/tracing.py); off without an endpoint."""

    otlp_traces_endpoint: str | None = None
    # "grpc" or "http/protobuf", from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL as vLLM reads it.
    otlp_traces_protocol: str = "grpc"
    # Also time the steps each request was in (gen_ai.latency.time_in_model_execute).
    collect_detailed_traces: DetailedTraces | None = None
    # The model name spans report (gen_ai.response.model); None: the model path's name.
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.otlp_traces_protocol not in ("grpc", "http/protobuf"):
            raise ValueError(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', "
                f"got {self.otlp_traces_protocol!r}"
            )
        if self.collect_detailed_traces not in (None, "model", "worker", "all"):
            raise ValueError(
                "collect_detailed_traces must be 'model', 'worker' or 'all', "
                f"got {self.collect_detailed_traces!r}"
            )
        if self.collect_detailed_traces is not None and self.otlp_traces_endpoint is None:
            raise ValueError("collect_detailed_traces needs otlp_traces_endpoint")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's defaults): how many one step may mix, their largest rank, and
    how many stay loaded in host memory."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
