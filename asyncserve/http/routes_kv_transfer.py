"""POST /kv_transfer/pull: a producer hands a consumer the KV blocks of a prefilled request
(asyncserve/disagg/kv_transfer.py). Server to server, behind the API key."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve.disagg.kv_transfer import PULL_PATH
from asyncserve.http.errors import APIError
from asyncserve.http.serving import ServerState


class PullRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    block_hashes: list[int]


def routes(state: ServerState) -> list[Route]:
    async def pull(request: Request) -> Response:
        transfer = getattr(state.engine, "kv_transfer", None)
        if transfer is None or not transfer.config.is_producer:
            raise APIError("this server is not a KV producer (--kv-transfer-config)", 400)
        body = await state.read_json(request, PullRequest)
        blob = await transfer.serve_pull(body.request_id, body.block_hashes)
        return Response(blob, media_type="application/octet-stream")

    return [Route(PULL_PATH, pull, methods=["POST"])]
