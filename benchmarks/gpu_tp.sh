#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (nvidia-h200-x2), results under $OUT:
#   tp_equality.json       TP=2 fp32 greedy equal to TP=1 (random-weight Llama and Qwen3-MoE,
#                          the latter also with expert parallelism)
#   w2_tp1.json, w2_tp2.json  W2: batch-1 ms per output token, dummy Llama-3-8B bf16, same call
#   allreduce_latency.json NCCL all-reduce latency at decode sizes (eager and in a CUDA graph)
#   tp_broadcast.json      per-step cost of the shared-memory step broadcast vs pickled pipes
#   logits_gather.json     the LM head's logits: all-gather to every rank vs gather to rank 0
# Run from the repository root: bash benchmarks/gpu_tp.sh
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-tp PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
L3=benchmarks/configs/llama3-8b
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" -e "tokenizer.json" | tee $OUT/$name.log | tail -${TAIL:-8}; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
W2="python3 -m asyncserve bench latency --model $L3 --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
step w2_tp1 200 $W2 -tp 1 --output-json $OUT/w2_tp1.json
step w2_tp2 240 $W2 -tp 2 --output-json $OUT/w2_tp2.json
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
try:
    one, two = (json.load(open(f"{out}/w2_tp{n}.json"))["ms_per_output_token"] for n in (1, 2))
    print(f"W2 batch 1: TP=1 {one:.2f} ms/token, TP=2 {two:.2f} ms/token, {one / two:.2f}x")
except (OSError, KeyError) as e:
    print("W2 comparison missing:", e)
PY
step allreduce 120 python3 benchmarks/allreduce_latency.py --ranks 2 --hidden 4096
TAIL=4 step tp_broadcast 200 python3 benchmarks/tp_broadcast.py --ranks 2 --steps 2000
TAIL=12 step logits_gather 120 python3 benchmarks/logits_gather.py --ranks 2 --vocab 128256 --output-json $OUT/logits_gather.json
TAIL=6 step tp_equality 400 python3 benchmarks/tp_equality.py --device cuda
