#!/usr/bin/env bash
# Shared by the GPU scripts (gpu_x4.sh, gpu_pending.sh; source it, do not run it): asyncserve's
# wheels installed into /tmp/site, the workloads' commands, `step` (one command, its log under
# $OUT), lanes (one function per GPU, in the background, ended at a deadline), servers, and
# `finish` (lane tails printed, results tarred into one file: a call returns few files).
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-x4 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site/starlette ] || { echo "asyncserve's wheels missing: run part prep (carry .whl) first"; exit 3; }
AS=/tmp/site:$PWD
VENV="PYTHONPATH=/tmp/site_v:$AS VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1"
SMOL=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
L3=benchmarks/configs/llama3-8b
SBS=benchmarks/side_by_side.py
W1B="python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
W2="python3 -m asyncserve bench latency --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
SERVE_BENCH="python3 -m asyncserve bench serve --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256"
export PYTHONPATH=$AS

# step NAME LIMIT CMD...: one command, its log in $OUT/NAME.log, its tail printed.
step() { name=$1; limit=$2; shift 2; echo "=== $name $(date +%T)"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" -e "tokenizer.json" > $OUT/$name.log; tail -${TAIL:-4} $OUT/$name.log; }
# lane GPU FUNCTION: the function on one GPU in the background, its output in $OUT/lane_FUNCTION.txt.
# Each lane is its own process group (set -m), so a lane still running at the deadline is
# ended whole and the results of the others still come back (the call's limit is 600 s).
set -m
LANES=()
lane() { (export CUDA_VISIBLE_DEVICES=$1; $2) > $OUT/lane_$2.txt 2>&1 & LANES+=($!); }
wait_lanes() {
  local deadline=$((SECONDS + ${DEADLINE:-540}))
  while [ $SECONDS -lt $deadline ]; do
    local alive=0
    for pid in "${LANES[@]}"; do kill -0 $pid 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return
    sleep 2
  done
  for pid in "${LANES[@]}"; do kill -0 $pid 2>/dev/null && { echo "lane $pid past the deadline: ended"; kill -- -$pid; }; done
  sleep 3
}
wait_up() { for i in $(seq 1 600); do curl -s localhost:$1/health >/dev/null && return 0; sleep 0.5; done; return 1; }
# serve_as / serve_vllm PORT NAME [flags]: a server in the background (pid in $SERVER).
serve_as() { port=$1; name=$2; shift 2; python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port $port --disable-uvicorn-access-log "$@" > $OUT/$name.log 2>&1 & SERVER=$!; wait_up $port || tail -5 $OUT/$name.log; }
serve_vllm() { port=$1; name=$2; shift 2; env $VENV python3 -m vllm.entrypoints.openai.api_server --model $L3 --load-format dummy --skip-tokenizer-init --max-model-len 2048 --port $port --disable-uvicorn-access-log "$@" > $OUT/$name.log 2>&1 & SERVER=$!; wait_up $port || tail -5 $OUT/$name.log; }
stop_server() { kill $SERVER; wait $SERVER 2>/dev/null; }
nsys_kernels() {  # nsys_kernels NAME CMD...: CUDA kernel time summary of one run
  name=$1; shift
  command -v nsys >/dev/null || { echo "no nsys"; return; }
  timeout 200 nsys profile -q -o /tmp/$name --force-overwrite true --trace cuda,nvtx "$@" > $OUT/$name.log 2>&1
  nsys stats -q --report cuda_gpu_kern_sum --format csv -o /tmp/$name /tmp/$name.nsys-rep > /dev/null 2>&1
  head -40 /tmp/${name}_cuda_gpu_kern_sum.csv > $OUT/$name.csv 2>/dev/null; tail -3 $OUT/$name.log
}

# finish PART: wait for the lanes, print their tails, tar $OUT into one file.
finish() {
  local part=$1
  wait_lanes
  for f in $OUT/lane_*.txt; do echo "##### $f"; tail -40 $f; done
  grep -H RESULT $OUT/*.log > $OUT/results.jsonl 2>/dev/null  # "LOG:RESULT {...}"
  (cd $OUT && tar -czf /tmp/results_$part.tgz . && rm -rf ./* && mv /tmp/results_$part.tgz .)
  echo "=== done $(date +%T)"
}
