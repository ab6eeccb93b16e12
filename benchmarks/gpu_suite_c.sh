#!/usr/bin/env bash
# GPU run C: SmolLM2 bf16 GPU vs fp32 CPU match rate, then W4 with the HF peer.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v "Warning" | tee $OUT/$name.log | tail -15; }
mkdir -p /tmp/smol && cat /tmp/gg/ggpart.aa .gg2/ggpart.ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf && ls -la /tmp/smol
export ASYNCSERVE_TEST_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
step gpu_match 150 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_engine.py
step w4 330 python3 -m asyncserve bench throughput --model benchmarks/configs/qwen3-0.6b --load-format dummy --num-prompts 256 --input-len 100 --input-len-max 1024 --output-len 100 --output-len-max 1024 --max-model-len 2048 --peer hf --output-json $OUT/w4.json
