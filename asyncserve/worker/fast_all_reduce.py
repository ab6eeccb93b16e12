"""One-shot all-reduce over symmetric memory for tensor parallelism's small reductions.

A decode step all-reduces tokens x hidden activations twice per layer: 8 KiB at batch 1,
where NCCL's ring pays a fixed latency 64 times a token for Llama-3-8B. With every rank's
buffer mapped into the others' address space (torch symmetric memory over NVLink peer
access), one kernel per rank copies its input in, waits on the others, and sums all the
buffers (vLLM's custom all-reduce works the same way). Reductions above `max_bytes`
(prefill chunks) stay on NCCL, which is faster there. NVLink multicast is never used.

Only the multi-process executor's CUDA ranks on one host use it, when every pair of GPUs has
peer access; `disable_custom_all_reduce` turns it off. A self-check at start compares it
with NCCL; any rank failing it leaves every rank on NCCL.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The world sizes torch's one-shot kernel is built for.
_WORLD_SIZES = frozenset({2, 4, 8})
DEFAULT_MAX_BYTES = 4 << 20


class SymmetricAllReduce:
    """Sums a rank's tensor with the same-shaped tensors of the group's other ranks."""

    def __init__(self, group_name: str, buffer: torch.Tensor, max_bytes: int) -> None:
        self.group_name = group_name
        self.buffer = buffer
        self.max_numel = max_bytes // buffer.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum in a new tensor, or None where NCCL should do it (too large, another
        dtype, not contiguous)."""
        if (
            x.dtype != self.buffer.dtype
            or x.numel() > self.max_numel
            or not x.is_contiguous()
            or x.numel() * x.element_size() % 16  # the kernel loads 16-byte vectors
        ):
            return None
        # The kernel wants the symmetric buffer in x's shape: a view of its first numel.
        staging = self.buffer[: x.numel()].view(x.shape)
        out: torch.Tensor = torch.ops.symm_mem.one_shot_all_reduce_copy(
            staging, x, "sum", self.group_name
        )
        return out


def _peer_access(size: int) -> bool:
    count = torch.cuda.device_count()
    if count < size:
        return False
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(size) for b in range(size) if a != b
    )


def _agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says True (NCCL, before anything else is collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build(
    rank: int, size: int, device: torch.device, dtype: torch.dtype,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> SymmetricAllReduce | None:  # fmt: skip
    """Collective over the default group: every rank calls it, all get one or all get None."""
    if device.type != "cuda" or size not in _WORLD_SIZES:
        return None
    usable = _peer_access(size)
    if not _agree(usable, device):
        log.info("custom all-reduce off: the GPUs lack peer access; NCCL all-reduces")
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch releases
            symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        reduce = SymmetricAllReduce(group_name, buffer, max_bytes)
        ok = _self_check(reduce, rank, size, device, dtype)
    except Exception as error:  # an unsupported driver or build: NCCL still works
        log.warning("custom all-reduce unavailable (%s); NCCL all-reduces", error)
        reduce, ok = None, False
    if not _agree(ok, device):
        return None
    log.info("custom all-reduce on (symmetric memory, one shot, up to %d bytes)", max_bytes)
    return reduce


def _self_check(
    reduce: SymmetricAllReduce, rank: int, size: int, device: torch.device, dtype: torch.dtype
) -> bool:
    """The one-shot sum equals NCCL's on a few shapes, including the largest it takes."""
    for rows in (1, 7, reduce.max_numel // 4096):
        x = torch.full((rows, 4096), float(rank + 1), dtype=dtype, device=device)
        x[:, rank % 4096] += 0.5
        got = reduce(x)
        expected = x.clone()
        dist.all_reduce(expected)
        if got is None or not torch.equal(got, expected):
            log.warning("custom all-reduce self-check failed at %d x 4096", rows)
            return False
    torch.cuda.synchronize(device)
    return True
