"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

Without it, a kernel starts only after the one before it has finished and flushed: at batch 1
a decode step is ~400 small kernels, and each pays its launch and the ramp of its first loads
while the GPU idles. A kernel launched with PDL may start while its predecessor still runs;
it must call `gdc_wait` (griddepcontrol.wait: the predecessor has completed and its writes
are visible) before it reads anything a kernel wrote. Before the wait it may only touch
what no kernel writes (weights): the GEMVs prefetch their first weight bytes into L2 there.

Each kernel here waits first and then lets its own successor launch (`gdc_launch_dependents`
after the wait, not before: a successor's blocks then overlap one kernel, not a chain of
waiting ones). A kernel launched without PDL (torch's, cuBLAS's) waits as usual, so PDL
kernels mix with any others. Off on CPU, under TRITON_INTERPRET, before sm_90, with a Triton
that lacks the instructions, or with ASYNCSERVE_PDL=0.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL stays off (pdl_enabled), the branches compile out
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_enabled", "pdl_launch", "pdl_prefetch_l2", "pdl_wait"]


@functools.lru_cache(maxsize=8)
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if device.type != "cuda" or gdc_wait is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("ASYNCSERVE_PDL") == "0":
        return False
    return _device_supports_pdl(device.index if device.index is not None else 0)


def pdl_launch(pdl: bool) -> dict[str, Any]:
    """The launch options of a kernel given PDL=pdl (Triton's `launch_pdl`)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the predecessor kernel's writes, then let the successor launch (no-op when
    PDL is off). Call it before the first read of anything a kernel wrote."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_prefetch_l2(ptrs, PDL: tl.constexpr):
    """Prefetch into L2 the lines holding `ptrs` (a tensor of pointers; only weights: it runs
    before the wait), while the predecessor kernel still runs. No-op when PDL is off."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            "=r,l",
            [ptrs.to(tl.int64)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
