#!/usr/bin/env bash
# GPU run A: sanity, W2, W1b, profile. Each step is capped so the rest still runs.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
Q3=benchmarks/configs/qwen3-0.6b
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/device.txt
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v "Warning" | tee $OUT/$name.log | tail -25; }
step sanity 90 python3 -m asyncserve bench throughput --model $Q3 --load-format dummy --num-prompts 64 --input-len 128 --output-len 64 --max-model-len 1024
step w2 150 python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json $OUT/w2.json
step w1b 220 python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --output-json $OUT/w1b.json
step profile 100 python3 benchmarks/profile_step.py --model $L3 --batch-size 256 --output-len 16
