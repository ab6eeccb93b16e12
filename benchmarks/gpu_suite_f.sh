#!/usr/bin/env bash
# GPU run F: GPU tests, then the GIL switch interval's effect on the batch-1 step and on
# grammar overhead (Python's default 5 ms vs 0.5 ms), and W2.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-f
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" -e "tokenizer.json" | tee $OUT/$name.log | tail -${TAIL:-14}; }
TAIL=3 step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py
for si in default 0.0005; do
  flag=""; [ $si = default ] || flag="--switch-interval $si"
  step phases_b1_$si 80 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 1 --output-len 128 $flag
  TAIL=4 step grammar_$si 100 python3 benchmarks/grammar_overhead.py --model $L3 --load-format dummy --device cuda --batch 64 --tokens 32 $flag
done
step w2 100 python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048
