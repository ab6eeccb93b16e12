"""PoolingEngine: embeds and scores, batching concurrent requests on one worker thread.

It has the surface the HTTP server needs from an engine (lifecycle, load gauges), so the
server runs a pooling model as it runs a generating one; the generation routes answer 400.
Requests wait in a queue; each batch takes what fits in max_num_batched_tokens and
max_num_seqs, runs off the event loop, and resolves its requests' futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from asyncserve.config import EngineConfig
from asyncserve.engine.setup import resolve_device
from asyncserve.metrics import EngineMetrics
from asyncserve.outputs import RequestOutput
from asyncserve.pooling.fair_queue import FairQueue
from asyncserve.pooling.model import PoolingModel
from asyncserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

NOT_GENERATIVE = (
    "this server runs a pooling model (--runner pooling): it embeds and scores "
    "(/v1/embeddings, /pooling, /score, /rerank) and does not generate text"
)


@dataclass
class _Job:
    token_ids: list[int]
    token_types: list[int] | None  # set: a cross-encoder pair to classify
    future: asyncio.Future[torch.Tensor] = field(repr=False)


def truncate_tokens(ids: list[int], keep: int | None) -> list[int]:
    """truncate_prompt_tokens: keep the last `keep` tokens (None: all)."""
    return ids if keep is None else ids[-keep:]


def truncation(keep: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens for pooling: -1 keeps what max_model_len holds; 0, other
    negatives and values over max_model_len are refused (as vLLM refuses them)."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {keep}")
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}); select a smaller truncation size"
        )
    return keep


class PoolingEngine:
    def __init__(
        self, config: EngineConfig, model: PoolingModel, metrics: EngineMetrics | None = None
    ) -> None:
        self.config = config
        self.model = model
        self.metrics = metrics
        self.tokenizer = model.tokenizer
        self.model_path = model.model_path
        self.max_model_len = model.max_model_len
        self.generation_config: dict[str, Any] = {}
        self._queue: FairQueue[_Job] = FairQueue()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._running = 0
        self._dead = asyncio.Event()
        self._dead_reason = ""

    @classmethod
    def from_config(
        cls, config: EngineConfig, metrics: EngineMetrics | None = None
    ) -> PoolingEngine:
        device = resolve_device(config.model.device)
        torch.manual_seed(config.model.seed)
        model = PoolingModel.load(config.model, device)
        logger.info(
            "pooling engine ready: %s on %s (%s pooling%s)",
            model.model_path,
            device,
            "cross-encoder" if model.is_cross_encoder else model.pooler.pooling_type,
            ", normalized" if model.pooler.normalize else "",
        )
        return cls(config, model, metrics)

    # ---- what the server reads ----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    kv_cache_usage = 0.0  # no KV cache is kept between batches
    num_free_blocks = 0
    num_total_blocks = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.is_running:
            return
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._batch_loop(), name="asyncserve-pooling")

    async def shutdown(self, timeout: float | None = None) -> None:
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained(), timeout)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))
        self._queue.clear()

    async def close(self) -> None:
        await self.shutdown(timeout=0)

    async def wait_until_dead(self) -> str:
        await self._dead.wait()
        return self._dead_reason

    async def _drained(self) -> None:
        while self._queue or self._running:
            await asyncio.sleep(0.01)

    # ---- generation is not served ----------------------------------------------------------

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        raise ValueError(NOT_GENERATIVE)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        raise ValueError(NOT_GENERATIVE)
        yield  # an async generator, as the protocol says

    async def abort(self, request_id: str) -> None:
        return None

    # ---- pooling ---------------------------------------------------------------------------

    def check_prompt(self, token_ids: list[int], field_name: str = "input") -> None:
        if not token_ids:
            raise ValueError(f"{field_name} must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"{field_name} has {len(token_ids)} tokens, more than the model's maximum "
                f"context length ({self.max_model_len})"
            )
        vocab = self.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field_name} has token id {bad}, outside the vocabulary ({vocab})")

    async def embed(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Pooled vectors (float32, normalized if the model says so), in input order."""
        if self.model.is_cross_encoder:
            raise ValueError("this model is a cross-encoder: it scores pairs (/score, /rerank)")
        return await self._submit([_Job(ids, None, self._future()) for ids in token_ids])

    async def classify(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """A cross-encoder's logits per (token ids, token type ids) pair."""
        if not self.model.is_cross_encoder:
            raise ValueError("this model is not a cross-encoder")
        return await self._submit([_Job(ids, types, self._future()) for ids, types in pairs])

    async def embed_inputs(
        self,
        items: list[str | list[int]],
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        fields: str | list[str] = "input",
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Texts (tokenized off the event loop) or token ids -> (vectors, token ids).
        `fields` names the items in errors: one name for all, or one per item."""
        keep = truncation(truncate_prompt_tokens, self.max_model_len)

        def tokenize() -> list[list[int]]:
            out = []
            for i, item in enumerate(items):
                ids = (
                    self.tokenizer.encode(item, add_special_tokens)
                    if isinstance(item, str)
                    else list(item)
                )
                ids = truncate_tokens(ids, keep)
                self.check_prompt(ids, fields if isinstance(fields, str) else fields[i])
                out.append(ids)
            return out

        ids = await asyncio.to_thread(tokenize)
        return await self.embed(ids), ids

    async def score(
        self,
        firsts: list[str],
        seconds: list[str],
        truncate_prompt_tokens: int | None = None,
        fields: tuple[str, str] = ("text_1", "text_2"),
    ) -> tuple[list[float], int]:
        """Relevance of each (first, second) pair and the tokens read: a cross-encoder's
        sigmoid of its one logit (else the last label's softmax probability), an embedding
        model's cosine similarity. `fields` names the two sides in errors."""
        if len(firsts) != len(seconds):
            raise ValueError("text_1 must be one text or as many texts as text_2")
        keep = truncation(truncate_prompt_tokens, self.max_model_len)
        if not self.model.is_cross_encoder:
            names = [fields[0]] * len(firsts) + [fields[1]] * len(seconds)
            vecs, ids = await self.embed_inputs([*firsts, *seconds], True, keep, names)
            k = len(firsts)
            sims = [float(F.cosine_similarity(vecs[i], vecs[k + i], dim=0)) for i in range(k)]
            return sims, sum(len(x) for x in ids)

        def encode() -> list[tuple[list[int], list[int]]]:
            pairs = []
            # encode_batch lets go of the GIL while it runs (see Tokenizer.encode).
            encodings = self.tokenizer.backend.encode_batch(list(zip(firsts, seconds, strict=True)))
            for enc in encodings:
                ids = truncate_tokens(enc.ids, keep)
                types = truncate_tokens(enc.type_ids, keep)
                self.check_prompt(ids, fields[1])
                pairs.append((ids, types))
            return pairs

        pairs = await asyncio.to_thread(encode)
        logits = await self.classify(pairs)
        scores = [
            float(torch.sigmoid(x[0])) if x.numel() == 1 else float(torch.softmax(x, -1)[-1])
            for x in logits
        ]
        return scores, sum(len(p[0]) for p in pairs)

    def _future(self) -> asyncio.Future[torch.Tensor]:
        return asyncio.get_running_loop().create_future()

    async def _submit(self, jobs: list[_Job]) -> list[torch.Tensor]:
        if not self.is_running:
            await self.start()
        for job in jobs:
            self.check_prompt(job.token_ids)
        key = self._queue.add(jobs)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(j.future for j in jobs)))
        finally:
            # A caller that went away leaves nothing queued behind it.
            self._queue.discard(key)

    def _take_batch(self) -> list[_Job]:
        budget = self.config.scheduler.max_num_batched_tokens
        return self._queue.take(self.config.scheduler.max_num_seqs, budget)

    def _run(self, batch: list[_Job]) -> list[torch.Tensor]:
        ids = [j.token_ids for j in batch]
        if batch[0].token_types is not None:
            types = [j.token_types or [] for j in batch]
            return list(self.model.classify(ids, types).cpu())
        return list(self.model.pool(ids).cpu())

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None
        try:
            while True:
                batch = self._take_batch()
                if not batch:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._running = len(batch)
                try:
                    results = await asyncio.to_thread(self._run, batch)
                except (ValueError, RuntimeError) as exc:
                    logger.exception("a pooling batch failed")
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                finally:
                    self._running = 0
                if self.metrics is not None:
                    self.metrics.on_tokens(sum(len(j.token_ids) for j in batch), 0)
                for job, result in zip(batch, results, strict=True):
                    if not job.future.done():
                        job.future.set_result(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the device failed: nothing more can be served
            self._dead_reason = f"pooling loop failed: {exc}"
            self._dead.set()
            raise
