"""Configuration: frozen dataclasses, and the only place environment variables are read.

sections.py     ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig
features.py     KVTransferConfig, ObservabilityConfig, LoRAConfig
multimodal.py   MultiModalConfig (media URL hosts, items per prompt, fetch timeout)
engine.py       EngineConfig (from_engine_args: vLLM's engine argument names)
environment.py  Environment (ASYNCSERVE_* variables), DataParallelRank
server.py       ServerConfig
typecheck.py    declared field and argument types checked at run time (one-line ValueErrors)
"""

from asyncserve.config.engine import EngineConfig
from asyncserve.config.environment import DataParallelRank, Environment
from asyncserve.config.features import (
    KV_CONNECTORS,
    DetailedTraces,
    KVRole,
    KVTransferConfig,
    LoRAConfig,
    ObservabilityConfig,
)
from asyncserve.config.multimodal import MultiModalConfig
from asyncserve.config.sections import (
    DEFAULT_DECODE_LATENCY_TARGET_MS,
    RAY_PLACEMENT_STRATEGIES,
    CacheConfig,
    DistributedExecutorBackend,
    LoadFormat,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)
from asyncserve.config.server import ServerConfig

__all__ = [
    "DEFAULT_DECODE_LATENCY_TARGET_MS",
    "KV_CONNECTORS",
    "RAY_PLACEMENT_STRATEGIES",
    "CacheConfig",
    "DataParallelRank",
    "DetailedTraces",
    "DistributedExecutorBackend",
    "EngineConfig",
    "Environment",
    "KVRole",
    "KVTransferConfig",
    "LoRAConfig",
    "LoadFormat",
    "ModelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
    "ServerConfig",
]
