#!/usr/bin/env bash
# GPU run B: W5 (cold, first), W6, W3. Also parks the first GGUF half for run C.
set -u
mkdir -p /tmp/gg && cp .gg1/* /tmp/gg/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cold
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v -e "Warning" -e "POST /v1" | tee $OUT/$name.log | tail -12; }
step w5 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 -- --max-model-len 2048
step w6 130 python3 benchmarks/prefix_cache.py --model $L3
python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/w3_server.log 2>&1 &
for i in $(seq 1 120); do curl -s localhost:8702/health >/dev/null && break; sleep 0.5; done
for rate in inf 16 4; do
  step w3_rate_$rate 150 python3 -m asyncserve bench serve --base-url http://127.0.0.1:8702 --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256 --request-rate $rate --output-json $OUT/w3_$rate.json
done
kill %1
