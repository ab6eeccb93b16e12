"""benchmarks/tune_moe.py on a tiny shape (Triton's interpreter on CPU): it keeps the fastest
config that computes the right output, and the table it writes is the one fused_moe reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import moe_config  # noqa: E402
from asyncserve.kernels.moe_config import MoEConfig  # noqa: E402
from benchmarks import tune_moe  # noqa: E402


def test_tuned_table_round_trips(tmp_path: Path, device: torch.device) -> None:
    shape = tune_moe.Shape("tiny", 4, 32, 32, 2, True, "softmax")
    configs = [MoEConfig(16, 16, 16, 1, 4, 2), MoEConfig(16, 32, 32, 2, 4, 2)]
    saved: list[tuple[dict[int, MoEConfig], list[dict[str, object]]]] = []
    tune_moe.tune_shape(
        shape,
        [1, 6],
        device,
        torch.float32,
        quick=True,
        rep_ms=5,
        on_progress=lambda table, rows: saved.append((dict(table), list(rows))),
        configs=configs,
    )
    table, rows = saved[-1]
    assert sorted(table) == [1, 6] and [r["M"] for r in rows] == [1, 6]
    for row in rows:
        assert row["configs_tried"] == 2 and row["configs_rejected"] == 0
        assert float(row["best_ms"]) <= float(row["default_ms"])  # type: ignore[arg-type]
    name = moe_config.config_file_name(4, 32, "cpu", "float32")
    (tmp_path / name).write_text(json.dumps({str(m): c.to_json() for m, c in table.items()}))
    moe_config.load_table.cache_clear()
    assert moe_config.choose_config(5, 4, 32, "float32", "cpu", tmp_path) == table[6]


def test_candidates_fit_shared_memory_and_the_shape() -> None:
    shape = tune_moe.Shape("qwen3-30b-a3b", 128, 768, 2048, 8, True, "softmax")
    small = list(tune_moe.candidates(shape, 1, quick=False))
    large = list(tune_moe.candidates(shape, 4096, quick=False))
    assert {c.block_m for c in small} == {16} and max(c.block_m for c in large) == 128
    for c in small + large:
        assert (c.block_m * c.block_k + 2 * c.block_n * c.block_k) * 2 * c.num_stages <= (
            tune_moe.SMEM_BYTES
        )
