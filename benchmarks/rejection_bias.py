"""Whether the rejection sampler keeps the target distribution on a device, with far more
draws than tests/spec_decode/test_rejection_sampler.py makes (its cases and logits).

For each case, --seeds runs of --requests requests with two proposals each. Per position
(the second: after an accepted first proposal): the chi-square of all runs' draws pooled (a
real bias grows with the count; no bias keeps it near its degrees of freedom), the largest
gap between the pooled frequencies and the target probabilities, and the share of single
runs whose p-value is below 0.01 (about 0.01 without bias). Writes $OUT/rejection_bias.json.

    python benchmarks/rejection_bias.py --device cuda [--requests 500000] [--seeds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.spec_decode.test_rejection_sampler import (  # noqa: E402
    SAMPLING_CASES,
    chi2_statistic,
    sample_two_positions,
)


def p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df / 2, stat / 2)."""
    shape = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(shape, torch.tensor(stat / 2, dtype=torch.float64)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=500_000)
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    results: list[dict[str, Any]] = []
    for params, one_hot in SAMPLING_CASES:
        pooled: list[list[torch.Tensor]] = [[], []]
        low = [0, 0]
        probs = None
        for seed in range(args.seeds):
            out, drafts, probs = sample_two_positions(params, one_hot, args.requests, device, seed)
            accepted = out[:, 0] == drafts[:, 0]
            for pos, samples in enumerate((out[:, 0], out[accepted, 1])):
                pooled[pos].append(samples)
                low[pos] += p_value(*chi2_statistic(samples, probs[pos])) < 0.01
        assert probs is not None
        for pos in (0, 1):
            samples = torch.cat(pooled[pos])
            stat, df = chi2_statistic(samples, probs[pos])
            freq = torch.bincount(samples, minlength=probs.shape[1]).double() / len(samples)
            row = {
                "case": f"temperature {params.temperature} top_k {params.top_k} top_p "
                f"{params.top_p}, {'one-hot' if one_hot else 'draft q'} proposals",
                "position": pos + 1,
                "draws": len(samples),
                "pooled_chi2": stat,
                "df": df,
                "pooled_p_value": p_value(stat, df),
                "max_abs_gap": float((freq - probs[pos].double()).abs().max()),
                "runs_below_p_0.01": low[pos] / args.seeds,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rejection_bias.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
