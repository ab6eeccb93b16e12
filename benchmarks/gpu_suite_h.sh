#!/usr/bin/env bash
# GPU run H: the engine in its new layout (core / worker / executor / output, one step loop).
#   part 1: GPU tests; W2 (async and sync), W1b, W3 at 16 req/s against BENCHMARKS.md.
#   part 2 (vLLM 0.26.0 installed in /tmp/site_v by ../shared/peers/vllm): both servers with
#           both clients all at once (`bench serve` vs benchmarks/raw_stream_client.py), then
#           W3 at 16 req/s against vLLM's server.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-h
AS_PATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
L3=benchmarks/configs/llama3-8b
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "POST /v1" -e "warnings.warn" -e "tokenizer.json" | tee $OUT/$name.log | tail -${TAIL:-14}; }
wait_up() { for i in $(seq 1 400); do curl -s localhost:$1/health >/dev/null && return 0; sleep 0.5; done; return 1; }
BENCH="python3 -m asyncserve bench serve --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256"
RAW="python3 benchmarks/raw_stream_client.py --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256"
if [ "${1:-1}" = bisect ]; then
  # W1b on two earlier trees (exported into .old/a and .old/b) and this one, same call.
  R=$PWD
  W1B="python3 -m asyncserve bench throughput --model $R/$L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
  for tree in .old/a .old/b .; do
    (cd $tree && PYTHONPATH=/tmp/site:$R/$tree step w1b_${tree//[.\/]/} 150 $W1B)
  done
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py tests/engine/test_async_scheduling_gpu.py tests/engine/test_gpu_engine.py -rs
elif [ "${1:-1}" = 3 ]; then
  # GPU tests; W1b alternating between an earlier tree and this one; the client check on a
  # warmed-up asyncserve server (its decode CUDA graphs are captured lazily, on first use).
  export PYTHONPATH=$AS_PATH
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py tests/engine/test_async_scheduling_gpu.py tests/engine/test_gpu_engine.py -rs
  R=$PWD
  W1B="python3 -m asyncserve bench throughput --model $R/$L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
  for tree in .old/b . .old/b .; do
    (cd $tree && PYTHONPATH=/tmp/site:$R/$tree step w1b_${tree//[.\/]/}_$RANDOM 150 $W1B)
  done
  python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/as_server4.log 2>&1 &
  pid=$!; wait_up 8702
  step as_warmup 150 $RAW --base-url http://127.0.0.1:8702 --model llama3-8b
  step as_inf_bench2 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate inf --output-json $OUT/as_inf_bench2.json
  step as_inf_raw2 150 $RAW --base-url http://127.0.0.1:8702 --model llama3-8b
  kill $pid; wait $pid
elif [ "${1:-1}" = 4 ]; then
  # GPU tests; W2 and W3 at 16 req/s on an earlier tree and this one, alternating.
  export PYTHONPATH=$AS_PATH
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py tests/engine/test_async_scheduling_gpu.py -rs
  R=$PWD
  W2="python3 -m asyncserve bench latency --model $R/$L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
  for tree in .old/b . .old/b .; do
    t=${tree//[.\/]/}
    (cd $tree && export PYTHONPATH=/tmp/site:$R/$tree && step w2_${t}_$RANDOM 100 $W2)
  done
  for tree in .old/b . .old/b .; do
    t=${tree//[.\/]/}
    (cd $tree && export PYTHONPATH=/tmp/site:$R/$tree
     python3 -m asyncserve serve --model $R/$L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/srv_$t.log 2>&1 &
     pid=$!; wait_up 8702
     cd $R && PYTHONPATH=$AS_PATH step w3_${t}_$RANDOM 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --output-json $OUT/w3_${t}_$RANDOM.json
     kill $pid; wait $pid)
  done
elif [ "${1:-1}" = 5 ]; then
  # W1b, W2 and W3 at 16 req/s in one call, this tree and an earlier one; each server warmed
  # up first (100 requests at once) so its decode CUDA graphs are captured before W3.
  R=$PWD
  W1B="python3 -m asyncserve bench throughput --model $R/$L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
  W2="python3 -m asyncserve bench latency --model $R/$L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
  for tree in ${TREES:-. .old/b}; do
    t=${tree//[.\/]/}
    (cd $tree && export PYTHONPATH=/tmp/site:$R/$tree
     [ -n "${SKIP_OFFLINE:-}" ] || { step w1b5_$t 150 $W1B; step w2_5_$t 100 $W2; }
     python3 -m asyncserve serve --model $R/$L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > /dev/null 2>&1 &
     pid=$!; wait_up 8702
     cd $R && export PYTHONPATH=$AS_PATH
     step warm_$t 100 $RAW --base-url http://127.0.0.1:8702 --model llama3-8b --num-prompts 100 --output-len 64
     step w3_5_$t 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --output-json $OUT/w3_5_$t.json
     kill $pid; wait $pid)
  done
elif [ "${1:-1}" = 1 ]; then
  export PYTHONPATH=$AS_PATH
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_structured_gpu.py tests/engine/test_async_scheduling_gpu.py tests/engine/test_gpu_engine.py -rs
  W2="python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
  step w2_async 100 $W2 --output-json $OUT/w2_async.json
  step w2_sync 100 $W2 --no-async-scheduling --output-json $OUT/w2_sync.json
  step w1b 150 python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048 --output-json $OUT/w1b.json
  python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/as_server.log 2>&1 &
  pid=$!; wait_up 8702
  step w3_as_16 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --output-json $OUT/w3_as_16.json
  kill $pid; wait $pid
else
  # asyncserve's server, both clients, all at once.
  PYTHONPATH=$AS_PATH python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/as_server2.log 2>&1 &
  pid=$!; wait_up 8702
  PYTHONPATH=$AS_PATH step as_inf_bench 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate inf --output-json $OUT/as_inf_bench.json
  PYTHONPATH=$AS_PATH step as_inf_raw 150 $RAW --base-url http://127.0.0.1:8702 --model llama3-8b
  kill $pid; wait $pid
  # vLLM's server, the same.
  PYTHONPATH=/tmp/site_v VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 python3 -m vllm.entrypoints.openai.api_server --model $L3 --load-format dummy --skip-tokenizer-init --max-model-len 2048 --port 8801 --disable-uvicorn-access-log > $OUT/vllm_server.log 2>&1 &
  pid=$!; wait_up 8801 || tail -20 $OUT/vllm_server.log
  PYTHONPATH=$AS_PATH step vllm_inf_bench 150 $BENCH --base-url http://127.0.0.1:8801 --request-rate inf --output-json $OUT/vllm_inf_bench.json
  PYTHONPATH=$AS_PATH step vllm_inf_raw 150 $RAW --base-url http://127.0.0.1:8801 --model $L3
  PYTHONPATH=$AS_PATH step w3_vllm_16 150 $BENCH --base-url http://127.0.0.1:8801 --request-rate 16 --output-json $OUT/w3_vllm_16.json
  kill $pid; wait $pid
  PYTHONPATH=$AS_PATH python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 --disable-uvicorn-access-log > $OUT/as_server3.log 2>&1 &
  pid=$!; wait_up 8702
  PYTHONPATH=$AS_PATH step w3_as_16 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --output-json $OUT/w3_as_16.json
  kill $pid; wait $pid
fi
# One archive: the device returns at most 8 files.
(cd $OUT && tar -czf ../results.tgz . && rm -rf ./* && mv ../results.tgz .)
