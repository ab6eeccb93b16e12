"""The engine's few contact points with disaggregated prefill, kept here so AsyncEngine
reads as before: building the KVTransfer, checking a request's kv_transfer_params, and the
output of a request whose pull failed."""

from __future__ import annotations

from urllib.parse import urlsplit

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.scheduler import Scheduler
from asyncserve.disagg.kv_group import KVGroup
from asyncserve.disagg.kv_transfer import KVTransfer
from asyncserve.executor.abstract import Executor
from asyncserve.executor.uniproc import UniProcExecutor
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import SamplingParams


def make_kv_transfer(
    config: EngineConfig,
    scheduler: Scheduler,
    executor: Executor,
    num_kv_heads: int,
    device: torch.device,
) -> KVTransfer | None:
    """The engine's KVTransfer; any tensor-parallel size on either side (blocks travel with
    all the model's KV heads; EngineConfig.checked refuses pipeline stages). A group
    connector's group runs NCCL when the engine is on CUDA and kv_buffer_device is "cuda"."""
    kv = config.kv_transfer
    if kv is None:
        return None
    if not config.cache.enable_prefix_caching:
        raise ValueError(
            "kv_transfer_config needs prefix caching: pulled blocks join the prefix cache"
        )
    group = None
    if kv.uses_group:
        on_gpu = device.type == "cuda" and kv.kv_buffer_device == "cuda"
        group = KVGroup(kv, device if on_gpu else torch.device("cpu"))
    in_process = isinstance(executor, UniProcExecutor)
    return KVTransfer(kv, scheduler.kv_cache_manager, executor, num_kv_heads, group, in_process)


def check_kv_transfer_params(transfer: KVTransfer | None, params: SamplingParams) -> None:
    """A ValueError naming kv_transfer_params when this engine cannot honour them."""
    raw = params.kv_transfer_params
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object")
    if transfer is None:
        raise ValueError("kv_transfer_params: this server runs without --kv-transfer-config")
    if params.n != 1:
        raise ValueError("kv_transfer_params: disaggregated prefill takes n = 1")
    if raw.get("do_remote_decode") and not transfer.config.is_producer:
        raise ValueError(f"kv_transfer_params: do_remote_decode needs a producer, this server "
                         f"is a {transfer.config.kv_role}")  # fmt: skip
    if raw.get("do_remote_prefill"):
        if not transfer.config.is_consumer:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs a consumer, this "
                             f"server is a {transfer.config.kv_role}")  # fmt: skip
        if not (
            isinstance(raw.get("remote_url"), str)
            and isinstance(raw.get("remote_request_id"), str)
            and isinstance(raw.get("remote_block_hashes"), list)
        ):
            raise ValueError(
                "kv_transfer_params: do_remote_prefill needs remote_url, remote_request_id and "
                "remote_block_hashes (a producer's kv_transfer_params, with its URL)"
            )
        _check_remote_url(raw["remote_url"], transfer.config.kv_producer_urls)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return (
        scheme,
        (parts.hostname or "").lower(),
        parts.port or {"http": 80, "https": 443}.get(scheme),
    )


def _check_remote_url(url: str, allowed: tuple[str, ...] = ()) -> None:
    """A producer's base URL: http(s), a host, nothing the pull path could not follow (the
    consumer POSTs to url + /kv_transfer/pull; a file: URL or a '#' would read elsewhere)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ValueError(
            f"kv_transfer_params: remote_url {url[:100]!r} is not valid: {exc}"
        ) from None
    problem = None
    if parts.scheme.lower() not in ("http", "https"):
        problem = "must be an http:// or https:// URL"
    elif not parts.hostname:
        problem = "has no host"
    elif parts.username is not None or parts.password is not None:
        problem = "must not carry credentials"
    elif parts.query or parts.fragment or "?" in url or "#" in url:
        problem = "must not have a query or fragment"
    elif allowed and _origin(url) not in {_origin(a) for a in allowed}:
        problem = (
            "is not one of this consumer's producers (kv_connector_extra_config.producer_urls)"
        )
    if problem is not None:
        raise ValueError(f"kv_transfer_params: remote_url {url[:100]!r} {problem} (the "
                         "producer's base URL)")  # fmt: skip


def failed_output(
    request_id: str, prompt: str | list[int], prompt_ids: list[int], n: int, error: str
) -> RequestOutput:
    """The one output of a request that could not get its KV blocks."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt_ids,
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
            for i in range(n)
        ],
        finished=True,
        error=error,
        internal_error=True,
    )
