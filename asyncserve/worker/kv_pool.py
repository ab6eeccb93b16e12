"""The KV pool of one device: how many blocks fit, and the per-layer K/V tensors.

On CUDA the largest step (max_num_batched_tokens) runs once first, so the pool gets what
gpu_memory_utilization leaves after the model's weights and its peak activations.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import EngineConfig
from asyncserve.kernels.parallel_compiles import START_UP, compile_for, compile_pass_runs
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.moe import kernel_warm_up_sizes
from asyncserve.worker.cuda_graphs import DecodeGraphs, capture_sizes, logits_forward
from asyncserve.worker.gemm_warm_up import GemmWarmUp
from asyncserve.worker.grammar_mask import warm_up_grammar_kernel

logger = logging.getLogger(__name__)

# KV pool on CPU when no byte budget is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's dtype: the model's, or e4m3 for --kv-cache-dtype fp8 (one byte a value;
    each layer's K and V carry a per-tensor scale, see models/attention.py)."""
    if cache_dtype == "auto":
        return model_dtype
    from asyncserve.quantization.fp8 import check_fp8_device

    check_fp8_device(device)
    return torch.float8_e4m3fn


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * element
    return per_layer * arch.num_hidden_layers


def allocate_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """One (key, value) pair of [num_blocks, block_size, kv_heads, head_dim] per layer."""
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]


def determine_num_blocks(
    model: Any,
    arch: ArchConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    cache = config.cache
    if cache.num_blocks_override is not None:
        return cache.num_blocks_override
    block_bytes = kv_block_bytes(arch, cache.block_size, dtype)
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        budget = _free_gpu_bytes_after_profile(model, arch, config, dtype, device, max_model_len)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // block_bytes
    # No point holding more than every seat filled to the longest sequence.
    blocks_per_seq = -(-max_model_len // cache.block_size)
    num_blocks = min(num_blocks, config.scheduler.max_num_seqs * blocks_per_seq + 1)
    if num_blocks < 1:
        raise ValueError(
            f"kv cache budget of {budget} bytes holds no block of {block_bytes} bytes; "
            "raise kv_cache_memory or gpu_memory_utilization"
        )
    return int(num_blocks)


def _free_gpu_bytes_after_profile(
    model: Any,
    arch: ArchConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Run the largest step once, then give the KV pool what the utilization target leaves."""
    _compile_start_up_kernels(model, arch, config, dtype, device, max_model_len)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _profile_run(model, arch, config, dtype, device, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory used by other processes / non-torch allocations counts against the target.
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - max(non_torch, 0)
    if config.enable_cuda_graphs:
        # Decode graphs keep their own activations and logits outside the profiled peak;
        # a draft model or EAGLE head has graphs of its own.
        rows = min(config.scheduler.max_num_seqs, config.max_cudagraph_capture_size)
        spec = config.speculative
        sets = 2 if spec is not None and spec.model is not None else 1
        budget -= sets * (rows * arch.vocab_size * 4 * 2 + (512 << 20))
        if spec is not None and spec.method not in ("eagle", "eagle3"):
            # Verification graphs (k + 1 rows a request, no more than a step's budget):
            # each size keeps its hidden states, the shared pool the largest one's
            # activations (about an MLP's width a row).
            q = spec.num_speculative_tokens + 1
            q_rows = min(rows * q, max(config.scheduler.max_num_batched_tokens, q))
            budget -= q_rows * (2 * arch.hidden_size + 3 * arch.intermediate_size) * 4
    logger.info(
        "GPU memory: total %.1f GiB, peak step %.1f GiB, KV budget %.1f GiB",
        total / 2**30,
        peak / 2**30,
        budget / 2**30,
    )
    return max(budget, 0)


def _compile_start_up_kernels(
    model: Any,
    arch: ArchConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> None:
    """Compile the profile step's kernels, the decode graphs' and the grammar mask's on
    threads, together (kernels/parallel_compiles.py): the graphs' own pass, once the pool is
    there, then finds theirs compiled. A cache of two blocks stands in for the pool: the
    kernels specialize on its strides, not on its number of blocks."""

    # Ranks of a group must agree on the pass (its forwards hold collectives): they skip no
    # pass, whatever each finds in its own cache.
    signature = None
    if device.type == "cuda" and not (dist.is_initialized() and dist.get_world_size() > 1):
        gpu = torch.cuda.get_device_properties(device)
        signature = (
            f"{config!r} {arch!r} {dtype} {max_model_len} {gpu.name} {gpu.major}.{gpu.minor}"
        )
    START_UP.begin(signature)
    rows = min(config.scheduler.max_num_seqs, config.max_cudagraph_capture_size)

    def forwards() -> None:
        # The pass lasts until its slowest compile ends (attention's, ~1 s): the forwards
        # meet the attention variants first. The grammar mask's, then the smallest decode
        # batches' (the split-KV variants) and the largest's, then the profile step's.
        warm_up_grammar_kernel(device)
        graphs = None
        if config.enable_cuda_graphs:
            block_size = config.cache.block_size
            caches = allocate_kv_caches(arch, 2, block_size, dtype, device)
            forward = logits_forward(model, caches, model.local_logits)
            graphs = DecodeGraphs(forward, rows, max_model_len, block_size, device)
            graphs.run_each_size(graphs.sizes[:4] + graphs.sizes[-1:])
        _profile_run(model, arch, config, dtype, device, max_model_len)
        if graphs is not None:
            graphs.run_each_size(graphs.sizes[4:-1])

    # The decode steps' GEMM shapes meet cuBLAS for the first time on a thread beside it.
    gemm_rows = [*capture_sizes(rows), min(config.scheduler.max_num_seqs, 512)]
    warm_up = GemmWarmUp(model, gemm_rows, device) if compile_pass_runs(device) else None
    try:
        compile_for(device, "the start-up steps", forwards)
    finally:
        if warm_up is not None:
            warm_up.join()


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int, device: torch.device | None = None
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The largest step as prompts of at most max_model_len tokens each, in blocks of their
    own (a step's budget may exceed the model's length, and positions past it would index
    past its position tables): its metadata and positions, on `device` (default CPU)."""
    seq_len = max(1, min(num_tokens, max_model_len))
    lens = [seq_len] * (num_tokens // seq_len)
    if num_tokens % seq_len:
        lens.append(num_tokens % seq_len)
    blocks_per_seq = -(-seq_len // block_size)
    tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), -1)
    # Sequence i's blocks are contiguous: its token j goes to slot i * blocks_per_seq *
    # block_size + j; its positions start at 0.
    slots = [torch.arange(n) + i * blocks_per_seq * block_size for i, n in enumerate(lens)]
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device),
        max_seqlen_q=seq_len,
        max_seqlen_k=seq_len,
    )
    return meta, positions.to(device)


def _profile_run(
    model: Any,
    arch: ArchConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> None:
    num_tokens = config.scheduler.max_num_batched_tokens
    block_size = config.cache.block_size
    meta, pos = profile_batch(num_tokens, max_model_len, block_size, device)
    caches = allocate_kv_caches(arch, meta.block_tables.numel(), block_size, dtype, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = model(ids, pos, caches, meta)
        rows = min(config.scheduler.max_num_seqs, num_tokens)
        model.driver_logits(hidden[:rows])
        # Steps of other sizes may pick other MoE kernel tiles: compiled here, not mid-run.
        parallel = config.parallel
        sizes = kernel_warm_up_sizes(arch.moe, parallel.tensor_parallel_size,
                                     parallel.enable_expert_parallel, num_tokens - 1, dtype,
                                     device)  # fmt: skip
        for size in sizes:
            meta, pos = profile_batch(size, max_model_len, block_size, device)
            model(ids[:size], pos, caches, meta)
    del caches, hidden
