#!/usr/bin/env bash
# GPU run: quantization (issue 14) on dummy Llama-3-8B, JSON results under $OUT.
#   part 1: GPU tests of the FP8 kernels and layers.
#   part 2: W2 (batch-1 ms per output token) and W1b (throughput), bf16 vs FP8 (quantized at
#           load, per-channel, torch._scaled_mm) vs FP8-block (128 x 128, Triton GEMM) vs
#           W4A16 (compressed-tensors int4, group 128: Triton GEMV / dequant-GEMM).
#   part 3 (vLLM 0.26.0 in /tmp/site_v, as in gpu_suite_h.sh): the same W2 / W1b with
#           `--quantization fp8` (and W2 on the W4A16 config), in the same call.
#   part 4: W3 at 16 req/s (server + `bench serve`), bf16 KV vs `--kv-cache-dtype fp8`
#           (TPOT within 5%, twice the KV blocks: see "KV blocks" in the server logs).
# Usage: OUT=/tmp/out bash benchmarks/gpu_suite_quant.sh [1|2|3|4|all]
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-quant
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
L3=benchmarks/configs/llama3-8b
L3B=benchmarks/configs/llama3-8b-fp8-block
L3W4=benchmarks/configs/llama3-8b-w4a16
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee $OUT/$name.log | tail -${TAIL:-8}; }
W2="python3 -m asyncserve bench latency --load-format dummy --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048"
W1B="python3 -m asyncserve bench throughput --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
part=${1:-all}
if [ "$part" = 1 ] || [ "$part" = all ]; then
  TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/kernels/test_int4_gemm.py tests/kernels/test_int4_gemv.py tests/kernels/test_fp8_kv.py tests/kernels/test_attention.py tests/kernels/test_kv_store.py tests/quantization -rs
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  step w2_bf16 150 $W2 --model $L3 --output-json $OUT/w2_bf16.json
  step w2_fp8 150 $W2 --model $L3 --quantization fp8 --output-json $OUT/w2_fp8.json
  step w2_fp8_block 150 $W2 --model $L3B --output-json $OUT/w2_fp8_block.json
  step w2_w4a16 150 $W2 --model $L3W4 --output-json $OUT/w2_w4a16.json
  TAIL=6 step int4_gemv 300 python3 benchmarks/int4_gemv_bench.py
  step w1b_bf16 200 $W1B --model $L3 --output-json $OUT/w1b_bf16.json
  step w1b_fp8 200 $W1B --model $L3 --quantization fp8 --output-json $OUT/w1b_fp8.json
  step w1b_fp8_block 200 $W1B --model $L3B --output-json $OUT/w1b_fp8_block.json
  step w1b_w4a16 200 $W1B --model $L3W4 --output-json $OUT/w1b_w4a16.json
fi
if [ "$part" = 3 ] || [ "$part" = all ]; then
  # vLLM 0.26.0: LLM(..., quantization="fp8", load_format="dummy") through its bench CLIs.
  V="env PYTHONPATH=/tmp/site_v VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 python3 -m vllm.entrypoints.cli.main bench"
  step vllm_w2_bf16 200 $V latency --model $L3 --load-format dummy --skip-tokenizer-init --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json $OUT/vllm_w2_bf16.json
  step vllm_w2_fp8 200 $V latency --model $L3 --quantization fp8 --load-format dummy --skip-tokenizer-init --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json $OUT/vllm_w2_fp8.json
  step vllm_w2_w4a16 200 $V latency --model $L3W4 --load-format dummy --skip-tokenizer-init --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json $OUT/vllm_w2_w4a16.json
  step vllm_w1b_fp8 300 $V throughput --model $L3 --quantization fp8 --load-format dummy --skip-tokenizer-init --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048 --output-json $OUT/vllm_w1b_fp8.json
fi
if [ "$part" = 4 ] || [ "$part" = all ]; then
  wait_up() { for i in $(seq 1 400); do curl -s localhost:$1/health >/dev/null && return 0; sleep 0.5; done; return 1; }
  BENCH="python3 -m asyncserve bench serve --num-prompts 500 --input-len 512 --output-len 128 --vocab-size 128256"
  for kv in auto fp8; do
    python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --kv-cache-dtype $kv --port 8702 --disable-uvicorn-access-log > $OUT/w3_server_$kv.log 2>&1 &
    pid=$!; wait_up 8702 || tail -20 $OUT/w3_server_$kv.log
    step w3_warmup_$kv 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --num-prompts 100
    step w3_kv_$kv 150 $BENCH --base-url http://127.0.0.1:8702 --request-rate 16 --output-json $OUT/w3_kv_$kv.json
    kill $pid; wait $pid
    grep -i -E "blocks|KV budget" $OUT/w3_server_$kv.log | head -3
  done
  # vLLM: the same server flags with --kv-cache-dtype fp8 (as in gpu_suite_h.sh part 2).
fi
