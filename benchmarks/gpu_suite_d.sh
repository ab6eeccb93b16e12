#!/usr/bin/env bash
# GPU run D: W5 phases (cold, first), structured outputs on the GPU, the batch-1 step
# breakdown (W2's host share), grammar overhead with the 8B dummy model at batch 64.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# W5 starts with an empty Triton cache; the later steps reuse what it compiled.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cold
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v -e "Warning" -e "POST /v1" | tee $OUT/$name.log | tail -${TAIL:-14}; }
TAIL=30 step w5 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 -- --max-model-len 2048
step structured_gpu 100 python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured_gpu.py
step phases_b1 100 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 1 --output-len 128
step grammar_gpu 150 python3 benchmarks/grammar_overhead.py --model $L3 --load-format dummy --device cuda --batch 64 --tokens 32
