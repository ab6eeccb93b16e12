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

With a group connector (P2pNcclConnector, PyNcclConnector) the pull stays the control
message, but the blocks travel over the pair's process group (disagg/kv_group.py): the
producer's reply names them and their dtype, and the payload follows on the group, GPU to
GPU when a one-rank instance's pool is on CUDA.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from asyncserve.config import KVTransferConfig
from asyncserve.core.kv_cache_manager import KVCacheManager
from asyncserve.disagg.kv_group import KVGroup, KVGroupError
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
        self,
        config: KVTransferConfig,
        kv: KVCacheManager,
        executor: Executor,
        num_kv_heads: int,
        group: KVGroup | None = None,
        in_process: bool = False,
    ) -> None:
        """`group`: the pair's process group (group connectors); `in_process`: the one
        worker runs in this process, so group payloads can stay on its device."""
        self.config = config
        self.group = group
        self._on_device = in_process and group is not None and group.device.type == "cuda"
        # Pulls over the group send their control message one at a time, in transfer order.
        self._group_order = asyncio.Lock()
        self._transfer_id = 0
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

    async def serve_pull(
        self, request_id: str, block_hashes: list[int], group: dict[str, Any] | None = None
    ) -> bytes:
        """The K/V of these blocks (those still cached here), then the hold is released.
        With `group` (address, token, transfer_id) the reply only names the blocks, which
        follow over the process group. Raises ValueError when this is not the pull's group."""
        self._expire()
        if group is not None:
            self._check_group(group)
        try:
            # Only the blocks this request holds, each once: a pull must not read (or probe)
            # the rest of the prefix cache, nor repeat one block to inflate the reply.
            held = {b.block_hash: b for b in self.kv.exports.get(request_id, ())}
            found = [(h, held.pop(h)) for h in block_hashes if h in held]
            hashes = [h for h, _ in found]
            data = torch.empty(0)
            meta = {"block_hashes": json.dumps(hashes)}
            if found and group is not None and self.group is not None:
                data, ready = await self._read_for_group([b.block_id for _, b in found])
                # Queued on the group thread before this reply, so in the consumer's order.
                sent = self.group.send(group["token"], group["transfer_id"], data, ready)
                sent.add_done_callback(_log_failed_send)
                meta["group_dtype"] = str(data.dtype).removeprefix("torch.")
                data = torch.empty(0)
            elif found:
                ids = [b.block_id for _, b in found]
                parts = await asyncio.wrap_future(self.executor.submit_rpc("read_kv_blocks", ids))
                data = merge_rank_heads(parts, self.num_kv_heads)
        finally:
            self.kv.release_export(request_id)
            self._expiry.pop(request_id, None)
        self.blocks_sent += len(hashes)
        return save_safetensors({"kv": data.contiguous()}, metadata=meta)

    def _check_group(self, group: dict[str, Any]) -> None:
        if self.group is None:
            raise ValueError(f"kv_group: this producer runs the {self.config.kv_connector}, "
                             "without a process group")  # fmt: skip
        if group.get("address") != self.group.address:
            raise ValueError(f"kv_group: this producer's KV group is at {self.group.address}, "
                             f"not {group.get('address')}")  # fmt: skip

    async def _read_for_group(self, block_ids: list[int]) -> tuple[torch.Tensor, Any]:
        """The blocks with all the KV heads, and the CUDA event they wait for (if any)."""
        if self._on_device:
            future = self.executor.submit_rpc("read_kv_blocks_on_device", block_ids)
            [(data, ready)] = await asyncio.wrap_future(future)
            return data, ready
        parts = await asyncio.wrap_future(self.executor.submit_rpc("read_kv_blocks", block_ids))
        return merge_rank_heads(parts, self.num_kv_heads), None

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
        if self.group is not None:
            peer = str(params.get("remote_engine_id", url))
            hashes, data = await self._pull_over_group(url, rid, missing, peer)
        else:
            hashes, data = self._parse(url, await asyncio.to_thread(self._fetch, url, rid, missing))
        if not hashes:
            return 0
        # The blocks join the shared prefix cache under these hashes: only those asked for.
        if len(set(hashes)) != len(hashes) or not set(hashes) <= set(missing):
            raise KVTransferError(f"KV transfer from {url}: the reply names blocks that "
                                  "were not asked for")  # fmt: skip
        blocks = self.kv.take_blocks_for_import(len(hashes))
        if blocks is None:
            logger.info("no room for %d pulled KV blocks: the prompt is computed here", len(hashes))
            return 0
        try:
            ids = [b.block_id for b in blocks]
            # Every rank writes its heads, or all say the blocks do not fit (the same check).
            problems = await asyncio.wrap_future(
                self.executor.submit_rpc("write_kv_blocks", ids, data)
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

    async def _pull_over_group(
        self, url: str, request_id: str, missing: list[int], peer: str
    ) -> tuple[list[int], torch.Tensor]:
        assert self.group is not None
        async with self._group_order:
            self._transfer_id += 1
            token, transfer_id = self.group.new_token(peer), self._transfer_id
            group = {"address": self.group.address, "token": token, "transfer_id": transfer_id}
            blob = await asyncio.to_thread(self._fetch, url, request_id, missing, group)
            hashes, _ = self._parse(url, blob)
            dtype_name = _metadata(blob).get("group_dtype")
            if not hashes or dtype_name is None:
                return [], torch.empty(0)
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise KVTransferError(f"KV transfer from {url}: unknown dtype {dtype_name!r}")
            received = self.group.recv(token, transfer_id, dtype)
        # The group bounds each op; this bounds the wait behind earlier ones as well (and an
        # NCCL communicator whose setup never returns).
        limit = 3 * self.config.kv_group_timeout_s
        try:
            data = await asyncio.wait_for(asyncio.wrap_future(received), limit)
        except KVGroupError as exc:
            raise KVTransferError(f"KV transfer from {url} failed: {exc}") from exc
        except TimeoutError as exc:
            raise KVTransferError(f"KV transfer from {url} failed: no blocks over the KV "
                                  f"group within {limit:g} s") from exc  # fmt: skip
        if len(data) != len(hashes):
            raise KVTransferError(f"KV transfer from {url}: {len(data)} blocks arrived for "
                                  f"{len(hashes)} named")  # fmt: skip
        # Worker processes take host tensors; the in-process worker writes from its device.
        return hashes, data if self._on_device else data.cpu()

    def _parse(self, url: str, blob: bytes) -> tuple[list[int], torch.Tensor]:
        try:
            tensors = load_safetensors(blob)
            hashes: list[int] = json.loads(_metadata(blob).get("block_hashes", "[]"))
        except Exception as exc:
            raise KVTransferError(f"KV transfer from {url}: a malformed reply ({exc})") from exc
        return hashes, tensors["kv"]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()

    def _fetch(
        self,
        url: str,
        request_id: str,
        block_hashes: list[int],
        group: dict[str, Any] | None = None,
    ) -> bytes:
        pull: dict[str, Any] = {"request_id": request_id, "block_hashes": block_hashes}
        if group is not None:
            pull["kv_group"] = group
        body = json.dumps(pull).encode()
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


def _log_failed_send(sent: Future[None]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("KV blocks not sent: %s", sent.exception())


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    meta: dict[str, str] = header.get("__metadata__", {})
    return meta
