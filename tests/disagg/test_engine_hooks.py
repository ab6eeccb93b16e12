"""disagg/engine_hooks.py: a consumer's kv_transfer_params name a producer it may pull from;
with `producer_urls` configured, only those (a caller cannot aim the pull, which carries the
server's API key, at any other host)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from asyncserve.config import KVTransferConfig
from asyncserve.disagg.engine_hooks import check_kv_transfer_params
from asyncserve.sampling_params import SamplingParams

PULL = {"do_remote_prefill": True, "remote_request_id": "r", "remote_block_hashes": [1]}


def consumer(**extra: Any) -> Any:
    config = KVTransferConfig.from_dict(
        {"kv_connector": "TCPConnector", "kv_role": "kv_consumer",
         "kv_connector_extra_config": extra}
    )  # fmt: skip
    return SimpleNamespace(config=config)


def check(transfer: Any, url: str) -> None:
    params = SamplingParams(max_tokens=4, kv_transfer_params={**PULL, "remote_url": url})
    check_kv_transfer_params(transfer, params)


def test_listed_producers_only() -> None:
    transfer = consumer(producer_urls=["http://10.0.0.5:8100", "https://prefill.example"])
    check(transfer, "http://10.0.0.5:8100")
    check(transfer, "HTTP://10.0.0.5:8100/")  # the same origin
    check(transfer, "https://PREFILL.example:443")
    for url in ("http://10.0.0.5:8101", "http://127.0.0.1:8100", "https://10.0.0.5:8100",
                "http://prefill.example"):  # fmt: skip
        with pytest.raises(ValueError, match="not one of this consumer's producers"):
            check(transfer, url)


def test_without_a_list_any_http_producer() -> None:
    check(consumer(), "http://127.0.0.1:8100")
    with pytest.raises(ValueError, match="http:// or https://"):
        check(consumer(), "file:///etc/passwd")


@pytest.mark.parametrize("urls", ["http://a:1", ["ftp://a"], ["http://"], [""], [3]])
def test_bad_producer_urls_are_config_errors(urls: object) -> None:
    with pytest.raises(ValueError, match="producer_urls"):
        consumer(producer_urls=urls)
