"""A model-free runner for scheduler tests.

It keeps per-request state from StepPlans the way the real runner does (new requests in full,
running ones as diffs, freed ids forgotten), writes every scheduled token into a fake paged
KV store (one token id per slot), then, after the whole batch is written (as each layer does
before attention), reads every request's context back through its block table and asserts it
holds that request's tokens. A request whose chunk reaches its last token "samples" a token
that depends only on the context it read, so wrong blocks change the output and a request
preempted and recomputed produces exactly the tokens it would have produced alone.

Also the helpers the scheduler tests share: building schedulers and requests, stepping,
and the invariants every plan and every drained pool must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncserve.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from asyncserve.core.request import Request
from asyncserve.core.scheduler import Scheduler
from asyncserve.core.step import StepPlan, StepResult
from asyncserve.sampling_params import SamplingParams

# Small blocks and vocabulary keep scheduler tests readable.
BS = 4
VOCAB = 1000


def next_token(context: list[int], vocab_size: int) -> int:
    """A deterministic stand-in for a model: the next token from the whole context."""
    return hash(tuple(context)) % vocab_size


@dataclass
class _State:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class FakeRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Queries read only the last `sliding_window` positions (as a windowed model does).
        self.sliding_window = sliding_window
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.states: dict[str, _State] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for rid in plan.freed_request_ids:
            self.states.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent in full twice"
            self.states[new.request_id] = _State(
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for cached in plan.running_requests:
            state = self.states[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, cached.request_id
            state.block_ids.extend(cached.new_block_ids)

        assert set(plan.num_scheduled_tokens) == {r.request_id for r in plan.new_requests} | {
            r.request_id for r in plan.running_requests
        }
        # Store this step's tokens for the whole batch first.
        for rid, count in plan.num_scheduled_tokens.items():
            state = self.states[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            tokens = state.tokens
            assert count >= 1 and end <= len(tokens), (rid, start, count, len(tokens))
            assert len(state.block_ids) * bs >= end, f"{rid}: too few blocks for {end} tokens"
            for pos in range(start, end):
                self.kv[state.block_ids[pos // bs]][pos % bs] = tokens[pos]
        # Then read each context back and sample where the chunk reaches the last token.
        result = StepResult()
        for rid, count in plan.num_scheduled_tokens.items():
            state = self.states[rid]
            end = state.num_computed_tokens + count
            first = 0
            if self.sliding_window is not None:
                first = max(state.num_computed_tokens - self.sliding_window + 1, 0)
            context = [self.kv[state.block_ids[p // bs]][p % bs] for p in range(first, end)]
            tokens = state.tokens
            assert context == tokens[first:end], f"{rid}: KV cache holds other tokens"
            state.num_computed_tokens = end
            if end == len(tokens):
                token = next_token(tokens, self.vocab_size)
                state.output_token_ids.append(token)
                result.sampled_token_ids[rid] = [token]
        return result


def check_plan(plan: StepPlan, scheduler: Scheduler) -> None:
    """Invariants every plan must hold."""
    counts = plan.num_scheduled_tokens
    assert plan.total_num_scheduled_tokens == sum(counts.values())
    assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(counts) <= scheduler.max_num_seqs
    assert scheduler.num_running <= scheduler.max_num_seqs
    # Batch order: running requests first, then new ones.
    order = [r.request_id for r in plan.running_requests] + [
        r.request_id for r in plan.new_requests
    ]
    assert list(counts) == order


def check_length_limits(plan: StepPlan, scheduler: Scheduler) -> None:
    """Nothing is computed past max_tokens or max_model_len, tokens in flight included."""
    for rid in plan.num_scheduled_tokens:
        request = scheduler.get_request(rid)
        assert request is not None
        assert request.num_computed_tokens <= request.num_prompt_tokens + request.max_tokens - 1
        assert request.num_computed_tokens <= scheduler.max_model_len - 1


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 10_000,
    async_scheduling: bool = False,
) -> tuple[list[StepPlan], list[Request]]:
    """Step until no request is left; returns the plans and the finished requests in order.

    With async_scheduling each step is planned before the scheduler sees the tokens of the
    step before (the runner holds them already, as the device does)."""
    plans: list[StepPlan] = []
    finished: list[Request] = []
    in_flight: tuple[StepPlan, StepResult] | None = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            return plans, finished
        plan = scheduler.schedule()
        check_plan(plan, scheduler)
        check_length_limits(plan, scheduler)
        finished.extend(scheduler.take_errored())
        plans.append(plan)
        done: tuple[StepPlan, StepResult] | None = (plan, runner.execute(plan))
        if async_scheduling:
            done, in_flight = in_flight, done if plan.num_scheduled_tokens else None
        if done is not None:
            finished.extend(r for r in scheduler.update(*done) if r.is_finished)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 32,
    max_seqs: int = 8,
    policy: SchedulingPolicy = "fcfs",
    prefix_caching: bool = True,
    max_model_len: int = 1024,
    sliding_window: int | None = None,
    decode_latency_target_ms: float = 0.0,
    max_concurrent_batches: int = 1,
) -> tuple[Scheduler, FakeRunner]:
    """decode_latency_target_ms is off by default here: these schedulers get no step times
    unless a test reports them."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            policy=policy,
            decode_latency_target_ms=decode_latency_target_ms,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        sliding_window=sliding_window,
        max_concurrent_batches=max_concurrent_batches,
    )
    return scheduler, FakeRunner(num_blocks, BS, VOCAB, sliding_window)


def make_request(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float = 0.0,
    eos: int | None = None,
    **params: object,
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    if eos is not None and not sampling.ignore_eos:
        sampling.all_stop_token_ids.add(eos)  # as the engine adds the model's EOS ids
    return Request(
        rid,
        tokens,
        sampling,
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival,
        max_tokens=max_tokens,
    )


def expected_output(request: Request, max_model_len: int = 1024) -> list[int]:
    """What the fake model produces for this request alone, up to its EOS or length."""
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    while len(out) < request.max_tokens and len(tokens) < max_model_len:
        token = next_token(tokens, VOCAB)
        tokens.append(token)
        out.append(token)
        if token == request.eos_token_id:
            break
    return out


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[StepPlan, list[Request]]:
    plan = scheduler.schedule()
    check_plan(plan, scheduler)
    return plan, scheduler.update(plan, runner.execute(plan))


def assert_all_blocks_back(scheduler: Scheduler) -> None:
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.kv_cache_manager.get_block_ids("any") == []
