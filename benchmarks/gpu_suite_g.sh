#!/usr/bin/env bash
# GPU run G: async scheduling (step N+1 planned and launched while step N runs).
#   part 1: GPU tests, W2 with and without async scheduling, W1b, W3 at 16 req/s;
#   part 2: W4 with the HF peer, W3 at 4 req/s and all at once.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-g
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
Q3=benchmarks/configs/qwen3-0.6b
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v -e "Warning" -e "POST /v1" -e "warnings.warn" -e "tokenizer.json" | tee $OUT/$name.log | tail -${TAIL:-14}; }
serve_w3() {  # rate...
  python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/w3_server.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -s localhost:8702/health >/dev/null && break; sleep 0.5; done
  for rate in "$@"; do
    step w3_rate_$rate 150 python3 -m asyncserve bench serve --base-url http://127.0.0.1:8702 --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256 --request-rate $rate --output-json $OUT/w3_$rate.json
  done
  kill $pid; wait $pid
}
if [ "${1:-1}" = 1 ]; then
  TAIL=4 step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py tests/engine/test_async_scheduling_gpu.py -rs
  W2="python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
  step w2_async 100 $W2 --output-json $OUT/w2_async.json
  step w2_sync 100 $W2 --no-async-scheduling --output-json $OUT/w2_sync.json
  step w1b 150 python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048 --output-json $OUT/w1b.json
  serve_w3 16
else
  step w4 330 python3 -m asyncserve bench throughput --model $Q3 --load-format dummy --num-prompts 256 --input-len 100 --input-len-max 1024 --output-len 100 --output-len-max 1024 --max-model-len 2048 --peer hf --output-json $OUT/w4.json
  serve_w3 4 inf
fi
