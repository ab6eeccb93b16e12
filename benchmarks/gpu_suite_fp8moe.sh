#!/usr/bin/env bash
# GPU run: FP8 MoE experts on dummy Qwen3-30B-A3B, logs and JSON results under $OUT.
#   part 1: the FP8 fused-MoE kernel against its reference on the GPU, and the FP8 MoE
#           model tests (CUDA path of the Triton kernel).
#   part 2: W2 (batch-1 ms per output token) and W1b (throughput): bf16 vs `--quantization
#           fp8` (per expert row, quantized at load) vs the FP8-block layout of
#           Qwen3-30B-A3B-FP8 (benchmarks/configs/qwen3-30b-a3b-fp8).
# Usage: OUT=/tmp/out bash benchmarks/gpu_suite_fp8moe.sh [1|2|all]
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-fp8moe
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
Q=benchmarks/configs/qwen3-30b-a3b
QF=benchmarks/configs/qwen3-30b-a3b-fp8
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee $OUT/$name.log | tail -${TAIL:-8}; }
W2="python3 -m asyncserve bench latency --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
W1B="python3 -m asyncserve bench throughput --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
part=${1:-all}
if [ "$part" = 1 ] || [ "$part" = all ]; then
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fp8.py tests/kernels/test_moe.py tests/quantization/test_fp8_moe.py -rs
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  step w2_bf16 200 $W2 --model $Q --output-json $OUT/w2_bf16.json
  step w2_fp8 200 $W2 --model $Q --quantization fp8 --output-json $OUT/w2_fp8.json
  step w2_fp8_block 200 $W2 --model $QF --output-json $OUT/w2_fp8_block.json
  step w1b_fp8 300 $W1B --model $Q --quantization fp8 --output-json $OUT/w1b_fp8.json
  step w1b_fp8_block 300 $W1B --model $QF --output-json $OUT/w1b_fp8_block.json
  step w1b_bf16 300 $W1B --model $Q --output-json $OUT/w1b_bf16.json
fi
