"""The token-budget scheduler: one loop for chunked prefill, decode, prefix hits and preemption.

Every request has num_computed_tokens catching up to num_tokens. Each step hands out at most
max_num_batched_tokens tokens to at most max_num_seqs requests: running requests first (a
decode gets 1 token, a long prompt a chunk), then waiting ones in queue order. When the pool
runs out of blocks, a running request is preempted by recompute (newest under fcfs, worst
(priority, arrival) under priority) and nothing new is admitted in that step.

While streams decode, the prefill tokens of a step (chunks of prompts, running or new) are
capped so that the step is expected to take at most decode_latency_target_ms, from the
measured step times the step loop reports (record_step_time; core/step_time.py). The cap is
never below one block, so prompts always progress.

A request that needs more blocks than the whole pool holds can never run: it is finished
with FINISHED_ERROR instead of looping, and handed to the engine through take_errored().

With async scheduling the next step is planned while the last one still runs: a request
whose token is being sampled holds a placeholder (num_output_placeholders) that the next
step already computes. A request that ends on that token (EOS, stop) has one wasted row in
the next step, whose token update() drops; length limits count placeholders, so nothing is
ever computed past max_tokens or max_model_len.

Speculative decoding: a decoding request with proposed tokens (Request.spec_token_ids, from
the last step's StepResult) gets them scheduled after its last token, so the step verifies
k + 1 positions; they count in the token budget and get slots like any token, and are cut so
the step can never produce more than max_tokens or reach past max_model_len. update()
rewinds num_computed_tokens past the rejected ones: their slots are written again by the
next step, and, holding no known token, they are never hashed for the prefix cache.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from asyncserve.config import CacheConfig, SchedulerConfig
from asyncserve.core.block_pool import BlockPool
from asyncserve.core.kv_cache_manager import KVCacheManager
from asyncserve.core.micro_batches import MicroBatches
from asyncserve.core.pool_capacity import blocks_needed
from asyncserve.core.request import Request, RequestStatus, count_decodes
from asyncserve.core.step import StepPlan, StepResult
from asyncserve.core.step_budget import StepBudget
from asyncserve.core.step_plan import build_step_plan
from asyncserve.core.step_time import StepTimeModel
from asyncserve.core.stop_rules import at_length_limit, check_stop
from asyncserve.core.waiting_queue import WaitingQueue
from asyncserve.spec_decode.proposals import take_proposals
from asyncserve.spec_decode.stats import SpecDecodeStats


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        max_loras: int | None = None,
        sliding_window: int | None = None,
        num_lookahead_tokens: int = 0,
        max_concurrent_batches: int = 1,
    ) -> None:
        """`max_loras`: most LoRA adapters one step may use (None: LoRA is off).
        `sliding_window`: set when every layer of the model attends through a window of
        that many positions; blocks behind it go back to the pool (KVCacheManager).
        `max_concurrent_batches`: pipeline parallelism's steps in flight (micro_batches.py)."""
        self.config = scheduler_config
        # Slots past each step's tokens for a draft model's proposals.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self._priority = scheduler_config.policy == "priority"
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.block_pool = BlockPool(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.sliding_window = sliding_window
        self.kv_cache_manager = KVCacheManager(
            self.block_pool,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            sliding_window,
        )
        self._requests: dict[str, Request] = {}
        self._waiting = WaitingQueue(self._priority)
        self._running: list[Request] = []
        # Requests the runner must forget, gathered until the next plan.
        self._freed_ids: set[str] = set()
        self._errored: list[Request] = []
        self.num_preemptions_total = 0
        self._removed_loras: set[int] = set()
        self.step_time = StepTimeModel()
        self._latency_target_s = scheduler_config.decode_latency_target_ms / 1000.0
        self.spec_stats = SpecDecodeStats()
        self.micro_batches = MicroBatches(max_concurrent_batches)

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        request.needs_output_tokens = request.sampling_params.needs_output_tokens
        self._requests[request.request_id] = request
        self._waiting.push(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finish waiting or running requests (abort, stop string); unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished: list[Request] = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is None or request.is_finished:
                continue
            was_running = request.status == RequestStatus.RUNNING
            request.status = status  # before free: how a request ended decides what it keeps
            if was_running:
                self._running.remove(request)
                self.kv_cache_manager.free(request)
            else:
                self._waiting.discard(request)
            self._release(request)
            finished.append(request)
        return finished

    def remove_lora(self, lora_int_id: int) -> None:
        """The adapter was unloaded: the next plan tells the runner to drop its weights."""
        self._removed_loras.add(lora_int_id)

    def lora_names(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests, sorted."""
        running: set[str] = set()
        waiting: set[str] = set()
        for request in self._requests.values():
            if request.lora_request is not None:
                names = running if request.status == RequestStatus.RUNNING else waiting
                names.add(request.lora_request.lora_name)
        return sorted(running), sorted(waiting)

    def take_errored(self) -> list[Request]:
        """Requests failed by schedule() (FINISHED_ERROR, with .error) since the last call."""
        errored, self._errored = self._errored, []
        return errored

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        """A finished step's size and duration, for the prefill cap."""
        self.step_time.observe(num_tokens, seconds)

    # ------------------------------------------------------------------------- scheduling

    def schedule(self) -> StepPlan:
        """Plan one step: running requests first, then waiting ones (none if this step had
        to preempt), within the token and sequence budgets."""
        step = StepBudget(self.max_num_batched_tokens, self._prefill_budget())
        step.max_requests = self.micro_batches.max_requests(len(self._requests), self.max_num_seqs)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return self._make_plan(step)

    def _prefill_budget(self) -> int | None:
        """Prefill tokens this step may take beside the running decodes; None: no cap (no
        target, no decode running, or no step measured yet)."""
        if self._latency_target_s <= 0:
            return None
        num_decodes = count_decodes(self._running)
        if num_decodes == 0:
            return None
        return self.step_time.prefill_budget(num_decodes, self._latency_target_s, self.block_size)

    def _schedule_running(self, step: StepBudget) -> None:
        """Give each running request its next tokens (a decode 1, a prompt a chunk), in order;
        when blocks run out, preempt until they fit (the request itself, last)."""
        running = self._running
        # Bound once: this loop runs for every running request every step.
        busy = self.micro_batches.busy if self.micro_batches.enabled else None
        max_model_len = self.max_model_len
        allocate = self.kv_cache_manager.allocate_slots
        lookahead = self.num_lookahead_tokens
        index = 0
        while index < len(running) and step.budget > 0 and not step.full:
            request = running[index]
            if busy is not None and busy(request):
                index += 1  # its step is still in the pipeline
                continue
            # Tokens known or in flight, less those computed (inline: every request, every step).
            num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_new = step.limit(
                num_known + request.num_output_placeholders - request.num_computed_tokens
            )
            if num_new <= 0 or (
                request.num_output_placeholders and at_length_limit(request, max_model_len)
            ):
                index += 1
                continue
            spec: list[int] = []
            if request.spec_token_ids:
                spec = take_proposals(request, num_new, step.budget, max_model_len)
                num_new += len(spec)
            if self._never_fits(request.num_computed_tokens + num_new):
                running.pop(index)
                self.kv_cache_manager.free(request)
                self._fail(request)
                continue
            block_ids = allocate(request, num_new, num_lookahead_tokens=lookahead)
            if block_ids is None:
                block_ids, index = self._allocate_or_preempt(request, num_new, index, step)
                if block_ids is None:
                    break  # it preempted itself; anything after it waits for the next step
            step.add_running(request, num_new, block_ids, spec)
            index += 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, index: int, step: StepBudget
    ) -> tuple[list[int] | None, int]:
        """Blocks for `num_new` more tokens of running[index], preempting victims (newest
        under fcfs, worst (priority, arrival) under priority) until they fit. Returns the
        new block ids (None when the request preempted itself) and its index now."""
        running = self._running
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if block_ids is not None:
                return block_ids, index
            if self._priority:
                victim = max(running, key=_priority_key)
                victim_index = running.index(victim)
                running.pop(victim_index)
                if victim_index < index:
                    index -= 1  # scheduled already this step: its tokens go back
                    step.remove_running(victim)
            else:
                victim = running.pop()
            self._preempt(victim)
            step.preempted = True
            if victim is request:
                return None, index

    def _schedule_waiting(self, step: StepBudget) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        kv = self.kv_cache_manager
        waiting = self._waiting
        # A step's adapters must fit the device's slots: a request whose adapter would exceed
        # them waits, keeping its place in line, and the ones behind it may go first.
        loras = {r.lora_int_id for r in self._running if r.lora_int_id} if self.max_loras else set()
        skipped: list[Request] = []
        while step.budget > 0 and len(self._running) < self.max_num_seqs and not step.full:
            request = waiting.peek()
            if request is None or self.micro_batches.busy(request):
                break  # (busy: preempted while in flight, admitted once its step is back)
            if request.num_output_placeholders:
                # Preempted while its last token was in flight: admitted once it is known.
                break
            if self._never_fits(request.num_tokens):
                waiting.pop()
                self._fail(request)
                continue
            lora_id = request.lora_int_id
            if lora_id and lora_id not in loras and self.max_loras and len(loras) >= self.max_loras:
                if len(skipped) >= self.max_num_seqs:
                    break  # bounded work per step
                skipped.append(waiting.pop())
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = step.limit(request.num_tokens - num_hit)
            if num_new <= 0:
                break  # the prefill cap is spent
            if kv.allocate_slots(request, num_new, hit_blocks, self.num_lookahead_tokens) is None:
                break  # never admit past a request that does not fit
            waiting.pop()
            kv.record_prefix_lookup(request, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self._running.append(request)
            if lora_id:
                loras.add(lora_id)
            step.add_new(request, num_new)
        for request in reversed(skipped):
            waiting.push_front(request)

    def _make_plan(self, step: StepBudget) -> StepPlan:
        plan = build_step_plan(step, self.kv_cache_manager, self.max_num_batched_tokens,
                               self._freed_ids, self._removed_loras)  # fmt: skip
        self._freed_ids = set()
        self._removed_loras = set()
        self.micro_batches.launched(plan, step.running, step.new)
        # The plan carries the start positions; from here on the tokens count as computed,
        # and a request whose chunk reaches its last token awaits the token sampled now.
        num_scheduled = step.num_scheduled
        needs_output_tokens = False
        for r in itertools.chain(step.running, step.new):
            r.num_computed_tokens += num_scheduled[r.request_id]
            pending = len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_output_placeholders
            if r.num_computed_tokens >= pending:  # pending: tokens known or in flight
                r.num_output_placeholders += 1
            if r.needs_output_tokens:
                needs_output_tokens = True
        plan.needs_output_tokens = needs_output_tokens
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Append sampled tokens, apply stop rules, release finished requests.

        Returns the requests that got tokens this step, finished ones included (one whose
        tokens are read at its end only once it ends). Requests finished (e.g. aborted) since
        the plan are skipped; one preempted since (async scheduling) still gets its token.
        """
        self.micro_batches.returned(plan)
        sampled = result.sampled_token_ids
        requests = self._requests
        updated: list[Request] = []
        any_finished = False
        now: float | None = None
        for rid in plan.num_scheduled_tokens:
            token_ids = sampled.get(rid)
            if not token_ids:
                continue
            request = requests.get(rid)
            if request is None or request.status >= _FIRST_FINISHED:
                continue
            request.num_output_placeholders = max(
                request.num_output_placeholders - len(token_ids), 0
            )
            preempted = request.status is _PREEMPTED
            spec = plan.scheduled_spec_tokens.get(rid)
            if spec is not None:
                num_accepted = len(token_ids) - 1
                self.spec_stats.observe(len(spec), num_accepted)
                if not preempted:
                    # The rejected proposals' K/V are stale: computed again from here.
                    request.num_computed_tokens -= len(spec) - num_accepted
            drafts = result.draft_token_ids.get(rid)
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                if check_stop(request, token_id, self.max_model_len):
                    if preempted:
                        # Its blocks went at preemption; only the waiting queue holds it.
                        self._waiting.discard(request)
                        self._release(request)
                    else:
                        any_finished = True
                    break
            if drafts and not request.is_finished:
                request.spec_token_ids = drafts
            if request.first_token_time is None:
                if now is None:
                    now = time.monotonic()
                request.first_token_time = now
            if not request.tokens_read_at_end or request.status >= _FIRST_FINISHED:
                updated.append(request)
        if any_finished:
            still_running: list[Request] = []
            for request in self._running:
                if request.is_finished:
                    self.kv_cache_manager.free(request)
                    self._release(request)
                else:
                    still_running.append(request)
            self._running = still_running
        return updated

    # --------------------------------------------------------------------------- helpers

    def _never_fits(self, num_tokens: int) -> bool:
        needed = blocks_needed(
            num_tokens, self.block_size, self.sliding_window, self.max_num_batched_tokens
        )
        return needed > self.num_blocks

    def _preempt(self, request: Request) -> None:
        """Recompute-preemption: drop the request's K/V and put it back in line."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._freed_ids.add(request.request_id)
        self._waiting.push_front(request)

    def _fail(self, request: Request) -> None:
        """The request needs more blocks than the pool holds; its blocks are freed already."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = (
            f"request {request.request_id} needs more KV cache blocks than the pool holds "
            f"({self.num_blocks} blocks of {self.block_size} tokens) at "
            f"{request.num_tokens} tokens"
        )
        self._release(request)
        self._errored.append(request)

    def _release(self, request: Request) -> None:
        del self._requests[request.request_id]
        self.micro_batches.forget(request.request_id)
        self._freed_ids.add(request.request_id)


# Module constants: compared for every request every step.
_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED
_PREEMPTED = RequestStatus.PREEMPTED


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
