"""One engine's side of disaggregated prefill: a producer keeps a finished request's prompt
blocks and hands them out; a consumer pulls the ones it lacks before it decodes.

Blocks travel by their prefix-cache hash (the chained hash of the tokens up to the block's
end), so the consumer asks only for what its own prefix cache misses, and the pulled blocks
simply join that cache: the request then finds its prompt there as a prefix hit and computes
only the last, partial block. The transport is HTTP between the two servers (TCP, works on
CPU and across hosts); the payload is one safetensors blob, [blocks, layers, 2, block_size,
kv_heads, head_dim] in the pool's dtype, with all the model's KV heads: under tensor
parallelism the producer joins its ranks' head slices and each consumer rank writes its own
(worker/kv_blocks.py), so the two may run different tensor-parallel sizes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from asyncserve.config import KVTransferConfig
from asyncserve.core.kv_cache_manager import KVCacheManager
from asyncserve.executor.abstract import Executor
from asyncserve.worker.kv_blocks import merge_rank_heads

logger = logging.getLogger(__name__)

PULL_PATH = "/kv_transfer/pull"
PULL_TIMEOUT_S = 60.0


class KVTransferError(RuntimeError):
    """A pull that failed: the peer is down, answered an error, or sent blocks that do not
    fit; the request that needed them fails with this message."""


class KVTransfer:
    def __init__(
        self, config: KVTransferConfig, kv: KVCacheManager, executor: Executor, num_kv_heads: int
    ) -> None:
        self.config = config
        self.kv = kv
        self.executor = executor
        self.num_kv_heads = num_kv_heads
        self.engine_id = uuid.uuid4().hex[:16]
        # Sent with pulls when the server has one (both ends of a pair share it).
        self.api_key: str | None = None
        self._expiry: dict[str, float] = {}
        self.blocks_sent = 0
        self.blocks_received = 0

    # ---- producer ------------------------------------------------------------------------

    def export_params(self, request_id: str) -> dict[str, Any] | None:
        """What a producer's response tells the consumer (vLLM's kv_transfer_params); None
        when this request kept no blocks. The proxy adds the producer's `remote_url`."""
        self._expire()
        held = self.kv.exports.get(request_id)
        if held is None:
            return None
        self._expiry[request_id] = time.monotonic() + self.config.kv_export_timeout_s
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_hashes": [b.block_hash for b in held],
        }

    async def serve_pull(self, request_id: str, block_hashes: list[int]) -> bytes:
        """The K/V of these blocks (those still cached here), then the hold is released."""
        self._expire()
        try:
            found = [(h, b) for h, b in zip(block_hashes, self.kv.cached_blocks(block_hashes),
                                            strict=True) if b is not None]  # fmt: skip
            hashes = [h for h, _ in found]
            data = torch.empty(0)
            if found:
                ids = [b.block_id for _, b in found]
                parts = await asyncio.wrap_future(self.executor.submit_rpc("read_kv_blocks", ids))
                data = merge_rank_heads(parts, self.num_kv_heads)
        finally:
            self.kv.release_export(request_id)
            self._expiry.pop(request_id, None)
        self.blocks_sent += len(hashes)
        return save_safetensors(
            {"kv": data.contiguous()}, metadata={"block_hashes": json.dumps(hashes)}
        )

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._expiry.items() if t < now]:
            logger.info("KV blocks of %s were not pulled in time; released", rid)
            self.kv.release_export(rid)
            del self._expiry[rid]

    # ---- consumer ------------------------------------------------------------------------

    async def pull(self, prompt_token_ids: list[int], params: dict[str, Any]) -> int:
        """Pull the prompt blocks this engine lacks from the producer named in `params`;
        returns how many arrived. Raises KVTransferError."""
        url = params.get("remote_url")
        rid = params.get("remote_request_id")
        remote = params.get("remote_block_hashes")
        if not isinstance(url, str) or not isinstance(rid, str) or not isinstance(remote, list):
            raise ValueError(
                "kv_transfer_params needs remote_url, remote_request_id and remote_block_hashes"
            )
        # The prefix cache never serves a prompt's last token: neither is it pulled.
        limit = (len(prompt_token_ids) - 1) // self.kv.block_size
        local = self.kv.prompt_block_hashes(prompt_token_ids)[:limit]
        usable = []
        for mine, theirs in zip(local, remote, strict=False):
            if mine != theirs:
                break  # a different prompt from here on (another template, truncation)
            usable.append(mine)
        missing = [
            h for h, b in zip(usable, self.kv.cached_blocks(usable), strict=True) if b is None
        ]
        # Even with nothing to pull the producer is told, so it lets its hold go.
        blob = await asyncio.to_thread(self._fetch, url, rid, missing)
        try:
            tensors = load_safetensors(blob)
            hashes = json.loads(_metadata(blob).get("block_hashes", "[]"))
        except Exception as exc:
            raise KVTransferError(f"KV transfer from {url}: a malformed reply ({exc})") from exc
        if not hashes:
            return 0
        blocks = self.kv.take_blocks_for_import(len(hashes))
        if blocks is None:
            logger.info("no room for %d pulled KV blocks: the prompt is computed here", len(hashes))
            return 0
        try:
            ids = [b.block_id for b in blocks]
            # Every rank writes its heads, or all say the blocks do not fit (the same check).
            problems = await asyncio.wrap_future(
                self.executor.submit_rpc("write_kv_blocks", ids, tensors["kv"])
            )
        except BaseException:
            self.kv.block_pool.free_blocks(blocks)
            raise
        if any(problems):
            self.kv.block_pool.free_blocks(blocks)
            raise KVTransferError(f"KV transfer from {url}: {next(p for p in problems if p)}")
        self.kv.register_imported(blocks, hashes)
        self.blocks_received += len(hashes)
        return len(hashes)

    def _fetch(self, url: str, request_id: str, block_hashes: list[int]) -> bytes:
        body = json.dumps({"request_id": request_id, "block_hashes": block_hashes}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url.rstrip("/") + PULL_PATH, body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=PULL_TIMEOUT_S) as response:  # noqa: S310
                data: bytes = response.read()
                return data
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise KVTransferError(
                f"KV transfer from {url} failed: HTTP {exc.code} {detail}"
            ) from exc
        except (OSError, urllib.error.URLError) as exc:
            raise KVTransferError(f"KV transfer from {url} failed: {exc}") from exc


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    meta: dict[str, str] = header.get("__metadata__", {})
    return meta
