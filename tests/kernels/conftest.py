"""Kernel tests run the Triton kernels compiled on CUDA, or in Triton's interpreter on CPU.

TRITON_INTERPRET must be set before the kernels are decorated (at import), so it is set
here, before pytest imports the test modules of this folder.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def bf16_rtne(device: torch.device) -> bool:
    """Whether fp32 -> bf16 casts inside kernels round to nearest even, as torch's do.

    Compiled kernels do; Triton's CPU interpreter truncates instead, so on CPU a bf16 result
    may sit one unit in the last place (toward zero) from the reference, and tests that are
    exact on CUDA compare within that unit there.
    """
    return device.type == "cuda"
