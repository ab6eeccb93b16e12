"""POST /kv_transfer/pull: a producer hands a consumer the KV blocks of a prefilled request
(asyncserve/disagg/kv_transfer.py). Server to server, behind the API key."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve.disagg.kv_transfer import PULL_PATH, KVTransfer
from asyncserve.http.errors import APIError
from asyncserve.http.serving import ServerState


class GroupPull(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the blocks go instead of the reply: the pair's process group (kv_group.py)."""

    address: str
    token: str
    transfer_id: int


class PullRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    block_hashes: list[int]
    kv_group: GroupPull | None = None


class TransferCounters:
    """Blocks sent and pulled, on /metrics beside the engine's own series."""

    def __init__(self, transfer: KVTransfer) -> None:
        self.transfer = transfer

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, value, doc in (
            ("kv_transfer_blocks_sent", self.transfer.blocks_sent, "KV blocks sent to consumers."),
            ("kv_transfer_blocks_received", self.transfer.blocks_received,
             "KV blocks pulled from producers."),
        ):  # fmt: skip
            yield CounterMetricFamily(f"asyncserve:{name}", doc, value=value)


def routes(state: ServerState) -> list[Route]:
    async def pull(request: Request) -> Response:
        transfer = getattr(state.engine, "kv_transfer", None)
        if transfer is None or not transfer.config.is_producer:
            raise APIError("this server is not a KV producer (--kv-transfer-config)", 400)
        body = await state.read_json(request, PullRequest)
        group = msgspec.structs.asdict(body.kv_group) if body.kv_group is not None else None
        try:
            blob = await transfer.serve_pull(body.request_id, body.block_hashes, group)
        except ValueError as exc:
            raise APIError(str(exc), 400) from exc
        return Response(blob, media_type="application/octet-stream")

    transfer = getattr(state.engine, "kv_transfer", None)
    registry = getattr(state.metrics, "registry", None)
    if transfer is not None and registry is not None:
        registry.register(TransferCounters(transfer))
    return [Route(PULL_PATH, pull, methods=["POST"])]
