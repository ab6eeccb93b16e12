"""Tune the fused MoE kernel's tiles per shape on this GPU; write the tables moe_config.py reads.

For each model (benchmarks/configs/NAME/config.json) and each batch size M, every candidate
tile config runs fused_moe on random bf16 weights and routing; a config whose output differs
from the default config's is dropped, the others are timed (CUDA graph replay, median) and the
fastest is kept. After each M the table is rewritten, so a run cut short still leaves the sizes
it finished. Written under --out:

    moe_configs/E={E},N={N},device_name={GPU},dtype=bfloat16.json   (copy into
        asyncserve/kernels/moe_configs/ to use it)
    tune_moe_summary.json   per shape and M: best config, its time, the default's, speedup

    OUT=/tmp/out python benchmarks/tune_moe.py --models powermoe-3b qwen3-30b-a3b mixtral-8x7b \\
        --out $OUT [--tp 1] [--batch-sizes 1 8 64 512 4096] [--quick]

--tp divides each expert's intermediate size as tensor parallelism does (N per rank).
--dry-run runs a tiny shape and two configs anywhere (TRITON_INTERPRET=1 on CPU), to check
the script itself.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import moe  # noqa: E402
from asyncserve.kernels.moe_config import (  # noqa: E402
    MoEConfig,
    choose_config,
    config_file_name,
    device_name,
    dtype_name,
)
from asyncserve.models.arch_config import ArchConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# H100/H200 have 228 KiB of shared memory per SM; leave room for the epilogue.
SMEM_BYTES = 200 * 1024


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    intermediate: int  # per rank
    hidden: int
    top_k: int
    renormalize: bool
    scoring: str

    @classmethod
    def from_model(cls, name: str, tp: int) -> Shape:
        arch = ArchConfig.from_hf_dict(json.loads((CONFIGS / name / "config.json").read_text()))
        if arch.moe is None:
            raise SystemExit(f"{name} has no MoE layers")
        if arch.moe.intermediate_size % tp:
            raise SystemExit(f"{name}: intermediate {arch.moe.intermediate_size} % tp {tp}")
        return cls(
            name,
            arch.moe.num_experts,
            arch.moe.intermediate_size // tp,
            arch.hidden_size,
            arch.moe.top_k,
            arch.moe.renormalize,
            arch.moe.scoring,
        )


def candidates(shape: Shape, num_tokens: int, quick: bool) -> Iterator[MoEConfig]:
    """Tile configs worth timing for this M: BLOCK_M near the rows an expert gets, tiles
    that fit in shared memory with their pipeline stages (the gate_up GEMM loads two weight
    tiles per step)."""
    rows_per_expert = max(1, num_tokens * shape.top_k // shape.num_experts)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)]
    block_ns = (64, 128) if quick else (32, 64, 128, 256)
    block_ks = (64, 128) if quick else (64, 128, 256)
    groups = (1, 16) if quick else (1, 8, 16, 32)
    warps = (4, 8)
    stages = (3, 4) if quick else (2, 3, 4, 5)
    for bm, bn, bk, group, warp, stage in itertools.product(
        block_ms, block_ns, block_ks, groups, warps, stages
    ):
        if (bm * bk + 2 * bn * bk) * 2 * stage > SMEM_BYTES:
            continue
        if bn > shape.intermediate or bk > shape.hidden:
            continue
        yield MoEConfig(bm, bn, bk, group, warp, stage)


def _timer(device: torch.device, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    if device.type != "cuda":
        return lambda fn: _wall_ms(fn)
    from triton.testing import do_bench, do_bench_cudagraph

    def time_ms(fn: Callable[[], object]) -> float:
        try:
            return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except RuntimeError:  # not capturable here: plain launches
            return float(do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))

    return time_ms


def _wall_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def tune_shape(
    shape: Shape,
    batch_sizes: list[int],
    device: torch.device,
    dtype: torch.dtype,
    quick: bool,
    rep_ms: int,
    on_progress: Callable[[dict[int, MoEConfig], list[dict[str, object]]], None],
    configs: list[MoEConfig] | None = None,
) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    e, n, h = shape.num_experts, shape.intermediate, shape.hidden
    w13 = (torch.randn(e, 2 * n, h, generator=gen, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, n, generator=gen, device=device) / n**0.5).to(dtype)
    time_ms = _timer(device, rep_ms)
    table: dict[int, MoEConfig] = {}
    rows: list[dict[str, object]] = []
    for m in batch_sizes:
        x = torch.randn(m, h, generator=gen, device=device).to(dtype)
        logits = torch.randn(m, e, generator=gen, device=device)
        weights, ids = moe.moe_route(logits, shape.top_k, shape.renormalize, shape.scoring)
        default = choose_config(m, e, n, "", "")  # the buckets, whatever the tables say

        # run(config) -> this batch's output with those tiles
        run = functools.partial(moe.fused_moe, x, w13, w2, weights, ids, None)
        expected = run(default).float()
        scale = expected.abs().max().item() + 1e-6
        default_ms = time_ms(functools.partial(run, default))
        best, best_ms, tried, failed = default, default_ms, 0, 0
        for config in configs if configs is not None else candidates(shape, m, quick):
            tried += 1
            try:
                err = (run(config).float() - expected).abs().max().item() / scale
                if err > 2e-2:
                    failed += 1
                    continue
                ms = time_ms(functools.partial(run, config))
            except Exception:  # a config the compiler or the GPU rejects
                failed += 1
                continue
            if ms < best_ms:
                best, best_ms = config, ms
        table[m] = best
        rows.append(
            {
                "model": shape.name,
                "E": e,
                "N": n,
                "hidden": h,
                "top_k": shape.top_k,
                "M": m,
                "best": best.to_json(),
                "best_ms": round(best_ms, 4),
                "default_ms": round(default_ms, 4),
                "speedup": round(default_ms / best_ms, 3),
                "configs_tried": tried,
                "configs_rejected": failed,
            }
        )
        print(
            f"{shape.name} E={e} N={n} M={m}: {best_ms:.4f} ms (default {default_ms:.4f}, "
            f"x{default_ms / best_ms:.2f}) {best}",
            flush=True,
        )
        on_progress(table, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["powermoe-3b", "qwen3-30b-a3b"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/out"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--quick", action="store_true", help="a smaller search space")
    parser.add_argument("--rep-ms", type=int, default=25, help="timing budget per config")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape, two configs")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = device_name(device) or "cpu"
    table_dir = args.out / "moe_configs"
    table_dir.mkdir(parents=True, exist_ok=True)
    summary: list[dict[str, object]] = []
    summary_path = args.out / "tune_moe_summary.json"

    if args.dry_run:
        shapes = [Shape("dry-run", 4, 32, 32, 2, True, "softmax")]
        configs: list[MoEConfig] | None = [
            MoEConfig(16, 16, 16, 1, 4, 2),
            MoEConfig(16, 32, 32, 2, 4, 2),
        ]
        batch_sizes = [1, 5]
    else:
        shapes = [Shape.from_model(name, args.tp) for name in args.models]
        configs = None
        batch_sizes = args.batch_sizes

    def save(
        name: str, first: int, table: dict[int, MoEConfig], rows: list[dict[str, object]]
    ) -> None:
        text = json.dumps({str(m): c.to_json() for m, c in sorted(table.items())}, indent=1)
        (table_dir / name).write_text(text + "\n")
        summary[first:] = rows
        summary_path.write_text(json.dumps({"device": gpu, "results": summary}, indent=1))

    for shape in shapes:
        name = config_file_name(shape.num_experts, shape.intermediate, gpu, dtype_name(dtype))
        progress = functools.partial(save, name, len(summary))
        tune_shape(shape, batch_sizes, device, dtype, args.quick, args.rep_ms, progress, configs)
    print(f"tables in {table_dir}, summary in {summary_path}")


if __name__ == "__main__":
    main()
