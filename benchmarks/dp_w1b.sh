#!/usr/bin/env bash
# W1b (1000 prompts x 256 in / 256 out, dummy Llama-3-8B) offline with data parallelism:
# DP=1 (one GPU) then DP=2 (one GPU per replica) in the same call, on a 2-GPU machine.
# Writes $OUT/w1b_dp1.json, $OUT/w1b_dp2.json and $OUT/w1b_dp.json (both and the ratio;
# the goal is DP=2 >= 1.9x DP=1 in total tok/s).
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
L3=benchmarks/configs/llama3-8b
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/device.txt
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v "Warning" | tee $OUT/$name.log | tail -25; }
W1B="python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
step w1b_dp1 200 $W1B --data-parallel-size 1 --output-json $OUT/w1b_dp1.json
step w1b_dp2 240 $W1B --data-parallel-size 2 --output-json $OUT/w1b_dp2.json
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for dp in (1, 2):
    path = out / f"w1b_dp{dp}.json"
    if path.exists():
        runs[f"dp{dp}"] = json.loads(path.read_text())
report = dict(runs)
if len(runs) == 2:
    report["ratio_total_tokens_per_s"] = (
        runs["dp2"]["total_tokens_per_s"] / runs["dp1"]["total_tokens_per_s"]
    )
    print(f"W1b DP=2 / DP=1 total tok/s: {report['ratio_total_tokens_per_s']:.2f}x (goal >= 1.9x)")
(out / "w1b_dp.json").write_text(json.dumps(report, indent=2))
PY
