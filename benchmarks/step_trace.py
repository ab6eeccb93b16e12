"""Where a decode step's time goes, kernel by kernel, from a GPU kernel trace.

With programmatic dependent launch, kernels overlap their neighbours, so a kernel's own
duration overstates what it costs the step. This reads `nsys stats --report cuda_gpu_trace
--format csv` (taken with `--cuda-graph-trace=node`, so graph replays show each kernel),
cuts the trace into steps at a marker kernel (the LM head's GEMM by default), and for each
kernel name sums, over a step, the time from its start to the next kernel's start: the
step's time split among its kernels (idle time counts to the kernel before it).
`side_by_side.py --kernel-summary PATH` writes such a CSV from the torch profiler
(PATH.trace.csv); with Nsight Systems:

    nsys profile -o /tmp/w2 --trace cuda --cuda-graph-trace=node python3 ... (a W2 run)
    nsys stats -q --report cuda_gpu_trace --format csv -o /tmp/w2 /tmp/w2.nsys-rep
    python3 benchmarks/step_trace.py /tmp/w2_cuda_gpu_trace.csv --marker nvjet
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict


def read_kernels(path: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of each row, in start order."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        start_col = next(i for i, h in enumerate(header) if h.startswith("Start"))
        dur_col = next(i for i, h in enumerate(header) if h.startswith("Duration"))
        name_col = next(i for i, h in enumerate(header) if h == "Name")
        # The grid tells launches of one kernel apart (the four GEMVs of a layer, say).
        grid_cols = [i for i, h in enumerate(header) if h in ("GrdX", "GrdY", "GrdZ")]
        for row in reader:
            if len(row) <= name_col:
                continue
            grid = "x".join(row[i] for i in grid_cols if row[i])
            name = short(row[name_col]) + (f" [{grid}]" if grid else "")
            rows.append((float(row[start_col]) / 1e3, float(row[dur_col]) / 1e3, name))
    rows.sort()
    return rows


def split_steps(
    rows: list[tuple[float, float, str]], marker: str
) -> list[list[tuple[float, float, str]]]:
    """Kernels from one marker kernel (inclusive) to the next (exclusive)."""
    steps: list[list[tuple[float, float, str]]] = []
    current: list[tuple[float, float, str]] | None = None
    for row in rows:
        if marker in row[2]:
            if current is not None:
                steps.append(current)
            current = []
        if current is not None:
            current.append(row)
    return steps


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:60].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--marker", default="nvjet", help="a substring of the step's last GEMM")
    parser.add_argument("--skip", type=int, default=20, help="steps left out at each end")
    args = parser.parse_args()
    steps = split_steps(read_kernels(args.csv), args.marker)
    # Steady decode steps: the most common kernel count, away from the run's ends.
    counts = statistics.mode(len(s) for s in steps)
    steady = [s for s in steps[args.skip : len(steps) - args.skip] if len(s) == counts]
    if len(steady) < 2:
        raise SystemExit(f"{len(steps)} steps, too few steady ones")
    step_us = []
    share: dict[str, list[float]] = defaultdict(list)
    own: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = defaultdict(int)
    for i in range(len(steady) - 1):
        step = steady[i] + [steady[i + 1][0]]  # the next step's first kernel ends the last
        step_us.append(step[-1][0] - step[0][0])
        per_name: dict[str, float] = defaultdict(float)
        per_own: dict[str, float] = defaultdict(float)
        for (start, dur, name), (next_start, _, _) in zip(step, step[1:], strict=False):
            per_name[name] += next_start - start
            per_own[name] += dur
        for name, us in per_name.items():
            share[name].append(us)
            own[name].append(per_own[name])
    for _, _, name in steady[0]:
        calls[name] += 1
    mean_step = statistics.mean(step_us)
    print(f"{len(steady)} steady steps of {counts} kernels: {mean_step:.1f} us a step")
    print("us a step (start to next start)\t% of step\tcalls\tus a call\town us a call\tname")
    for name in sorted(share, key=lambda n: -statistics.mean(share[n])):
        us = statistics.mean(share[name])
        print(
            f"{us:.1f}\t{100 * us / mean_step:.1f}\t{calls[name]}\t{us / calls[name]:.2f}\t"
            f"{statistics.mean(own[name]) / calls[name]:.2f}\t{name}"
        )
    # The step in order, each position averaged over the steady steps: where each kernel
    # starts, how long until the next starts, and its own duration.
    print("# positions in order: offset us, start-to-next us, own us, name (first 40)")
    for pos in range(min(40, counts)):
        offset = statistics.mean(s[pos][0] - s[0][0] for s in steady)
        gap = statistics.mean(
            (s[pos + 1][0] if pos + 1 < counts else n[0][0]) - s[pos][0]
            for s, n in zip(steady, steady[1:], strict=False)
        )
        dur = statistics.mean(s[pos][1] for s in steady)
        print(f"{offset:.1f}\t{gap:.2f}\t{dur:.2f}\t{steady[0][pos][2]}")


if __name__ == "__main__":
    main()
