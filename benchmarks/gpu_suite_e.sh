#!/usr/bin/env bash
# GPU run E, in two calls (each under the device's 10-minute limit):
#   part 1: startup phases and W5 (cold Triton cache), kernel and GPU tests, the batch-1 step
#           breakdown, W2, grammar overhead with the 8B dummy model;
#   part 2: batch-1 profile and step breakdown, grammar overhead, W4 with the HF peer,
#           W3 at 16 req/s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cold
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
Q3=benchmarks/configs/qwen3-0.6b
step() { name=$1; t=$2; shift 2; echo "=== $name"; timeout $t "$@" 2>&1 | grep -v -e "Warning" -e "POST /v1" -e "warnings.warn" | tee $OUT/$name.log | tail -${TAIL:-14}; }
if [ "${1:-1}" = 1 ]; then
  step startup 60 python3 -c "
import time; t0 = time.perf_counter()
import asyncserve.engine.async_engine, asyncserve.http.app; t1 = time.perf_counter()
import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f'imports {t1 - t0:.2f} s, CUDA context {t2 - t1:.2f} s')"
  TAIL=20 step w5 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 -- --max-model-len 2048
  step kernels 150 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py
  step phases_b1 90 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 1 --output-len 128
  step w2 100 python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json $OUT/w2.json
  step grammar_gpu 120 python3 benchmarks/grammar_overhead.py --model $L3 --load-format dummy --device cuda --batch 64 --tokens 32
else
  step profile_b1 90 python3 benchmarks/profile_step.py --model $L3 --batch-size 1 --input-len 128 --output-len 24 --sort self_cpu_time_total --rows 30 --trace $OUT/trace_b1.json
  step phases_b1 90 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 1 --output-len 128
  step grammar_gpu 120 python3 benchmarks/grammar_overhead.py --model $L3 --load-format dummy --device cuda --batch 64 --tokens 32
  step w4 300 python3 -m asyncserve bench throughput --model $Q3 --load-format dummy --num-prompts 256 --input-len 100 --input-len-max 1024 --output-len 100 --output-len-max 1024 --max-model-len 2048 --peer hf --output-json $OUT/w4.json
  python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/w3_server.log 2>&1 &
  for i in $(seq 1 120); do curl -s localhost:8702/health >/dev/null && break; sleep 0.5; done
  step w3_rate_16 150 python3 -m asyncserve bench serve --base-url http://127.0.0.1:8702 --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256 --request-rate 16 --output-json $OUT/w3_16.json
  kill %1
fi
