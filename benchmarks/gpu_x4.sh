#!/usr/bin/env bash
# GPU runs on a 4-GPU host (nvidia-h100-x4), one lane per GPU running side by side; inside a
# lane asyncserve and vLLM 0.26.0 run one after the other on the same GPU and inputs. Five
# calls back to back (the machine keeps /tmp only while it stays warm); results under $OUT.
# Here first: ../shared/peers/vllm/build.sh (.peer/), ../shared/device-wheels copied to .whl/,
# SmolLM2's GGUF split into .smol/a/part and .smol/b/part (+ .smol/b/sha256).
#   1 prep     carry .whl .smol/a: asyncserve's wheels; W1b at 256/512/1024 sequences, cold
#              start, PowerMoE, and nsys kernel summaries of W2 at TP=1 and TP=2
#   2 smol     carry .smol/b: SmolLM2 assembled; the GPU test files; speculative decoding,
#              FP8-MoE tests and LLaVA with asyncserve
#   3 stage    carry .peer/p0: vLLM part 0 staged; quantized W2/W1b and FP8 KV with asyncserve
#   4 side     carry .peer/p1: vLLM installed; LoRA, LLaVA, W1b + W4, speculative decoding,
#              each engine in turn on its lane's GPU
#   5 side2    (warm) W3 at 16 req/s and all at once, FP8 KV W3, FP8 W2/W1b, W4A16 W2
# Usage: bash benchmarks/gpu_x4.sh prep|smol|stage|side|side2
source "$(dirname "$0")/gpu_lanes.sh"

# --- part 1: asyncserve alone -----------------------------------------------------------
p1_w1b() {
  TAIL=2 step w1b_256 200 $W1B --output-json $OUT/w1b_256.json
  TAIL=2 step w1b_512 200 $W1B --max-num-seqs 512 --max-num-batched-tokens 16384 --output-json $OUT/w1b_512.json
  TAIL=2 step w1b_1024 200 $W1B --max-num-seqs 1024 --max-num-batched-tokens 16384 --output-json $OUT/w1b_1024.json
}
p1_start() {
  TAIL=3 step cold_start 120 python3 benchmarks/cold_start.py --model $L3 --port 8711
  TAIL=3 step cold_start2 120 python3 benchmarks/cold_start.py --model $L3 --port 8712
  TAIL=2 step powermoe 250 python3 $SBS --engine asyncserve --workloads w2,w1b --model benchmarks/configs/powermoe-3b
  nsys_kernels nsys_tp1 python3 $SBS --engine asyncserve --workloads w2 --model $L3
}
p1_tp2() { nsys_kernels nsys_tp2 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --tensor-parallel-size 2; }

# --- part 2: SmolLM2 present ---------------------------------------------------------------
GPU_TESTS="tests/kernels tests/engine/test_gpu_engine.py  tests/engine/test_async_scheduling_gpu.py tests/worker tests/quantization tests/lora/test_lora_gpu.py tests/models/test_sliding_window_kv.py tests/spec_decode"
p2_tests() { ASYNCSERVE_TEST_GGUF=$SMOL TAIL=25 step gpu_tests 500 python3 -m pytest -q -p no:cacheprovider -rfs $GPU_TESTS; }
p2_spec() { TAIL=30 step spec_as 400 python3 benchmarks/spec_decode.py --gguf $SMOL; }
p2_moe() { TAIL=6 step fp8moe_tests 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fp8.py tests/quantization -k "moe or Moe" -rs; }
p2_llava() { TAIL=3 step llava_as_pre 400 python3 benchmarks/llava_bench.py --engine asyncserve --model-dir /tmp/llava-7b-dummy --output-json $OUT/llava_as_pre.json; }

# --- part 3: quantized, asyncserve alone -----------------------------------------------------
p3_fp8() {
  TAIL=2 step w2_bf16 150 $W2 --model $L3 --output-json $OUT/w2_bf16.json
  TAIL=2 step w2_fp8 150 $W2 --model $L3 --quantization fp8 --output-json $OUT/w2_fp8.json
  TAIL=2 step w2_w4a16 150 $W2 --model benchmarks/configs/llama3-8b-w4a16 --output-json $OUT/w2_w4a16.json
}
p3_w1b() {
  TAIL=2 step w1b_bf16 200 $W1B --output-json $OUT/w1b_bf16.json
  TAIL=2 step w1b_fp8 200 $W1B --quantization fp8 --output-json $OUT/w1b_fp8.json
}
p3_kv() {
  for kv in auto fp8; do
    serve_as 8720 w3_server_$kv --kv-cache-dtype $kv
    step w3_warm_$kv 150 $SERVE_BENCH --base-url http://127.0.0.1:8720 --request-rate 16 --num-prompts 100
    TAIL=12 step w3_kv_$kv 150 $SERVE_BENCH --base-url http://127.0.0.1:8720 --request-rate 16 --output-json $OUT/w3_kv_$kv.json
    stop_server; grep -i -E "KV cache|blocks" $OUT/w3_server_$kv.log | head -3
  done
}
p3_w2fp8block_tests() { TAIL=2 step w2_fp8_block 150 $W2 --model benchmarks/configs/llama3-8b-fp8-block --output-json $OUT/w2_fp8_block.json; p2_tests; }

# --- part 4: side by side ------------------------------------------------------------------
p4_lora() {
  TAIL=3 step lora_as_8 250 python3 benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_8.json
  TAIL=12 step lora_vllm_8 330 env $VENV python3 benchmarks/lora_throughput.py --engine vllm --num-adapters 8 --output-json $OUT/lora_vllm_8.json
}
p4_llava() {
  TAIL=3 step llava_as 200 python3 benchmarks/llava_bench.py --engine asyncserve --output-json $OUT/llava_as.json
  # vLLM's LLaVA imports a transformers name the image's transformers renamed (peer_shims/).
  TAIL=6 step llava_vllm 380 env $VENV PYTHONPATH=$PWD/benchmarks/peer_shims:/tmp/site_v:$AS python3 benchmarks/llava_bench.py --engine vllm --output-json $OUT/llava_vllm.json
}
p4_w1b_w4() {
  TAIL=2 step sbs_as_w1b 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3
  TAIL=2 step sbs_vllm_w1b 250 env $VENV python3 $SBS --engine vllm --workloads w1b --model $L3
  TAIL=2 step sbs_as_w4 100 python3 $SBS --engine asyncserve --workloads w4 --model benchmarks/configs/qwen3-0.6b
  TAIL=2 step sbs_vllm_w4 150 env $VENV python3 $SBS --engine vllm --workloads w4 --model benchmarks/configs/qwen3-0.6b
}
p4_tests_spec() {
  p2_tests
  TAIL=30 step spec_vllm 300 env $VENV python3 benchmarks/spec_decode.py --engine vllm
}
p4_spec() {
  TAIL=12 step spec_as 250 python3 benchmarks/spec_decode.py --gguf $SMOL
  TAIL=30 step spec_vllm 330 env $VENV python3 benchmarks/spec_decode.py --engine vllm
}

# --- part 5: side by side, second round -------------------------------------------------------
p5_w3() {
  serve_vllm 8740 w3_vllm_server
  step w3_vllm_warm 100 $SERVE_BENCH --base-url http://127.0.0.1:8740 --request-rate 16 --num-prompts 100
  TAIL=12 step w3_vllm 100 $SERVE_BENCH --base-url http://127.0.0.1:8740 --request-rate 16 --output-json $OUT/w3_vllm.json
  TAIL=12 step w3_vllm_inf 100 $SERVE_BENCH --base-url http://127.0.0.1:8740 --request-rate inf --output-json $OUT/w3_vllm_inf.json
  stop_server
  serve_as 8741 w3_as_server2
  step w3_as_warm2 100 $SERVE_BENCH --base-url http://127.0.0.1:8741 --request-rate 16 --num-prompts 100
  TAIL=12 step w3_as2 100 $SERVE_BENCH --base-url http://127.0.0.1:8741 --request-rate 16 --output-json $OUT/w3_as2.json
  TAIL=12 step w3_as_inf 100 $SERVE_BENCH --base-url http://127.0.0.1:8741 --request-rate inf --output-json $OUT/w3_as_inf.json
  stop_server
}
p5_kv() {  # vLLM's W3 with an FP8 KV cache, beside asyncserve's (part 3 has both engines' bf16 KV)
  serve_vllm 8750 w3_vllm_kv_server --kv-cache-dtype fp8
  step w3_vllm_kv_warm 100 $SERVE_BENCH --base-url http://127.0.0.1:8750 --request-rate 16 --num-prompts 100
  TAIL=12 step w3_vllm_kv_fp8 100 $SERVE_BENCH --base-url http://127.0.0.1:8750 --request-rate 16 --output-json $OUT/w3_vllm_kv_fp8.json
  stop_server; grep -i -E "KV cache size|GPU KV" $OUT/w3_vllm_kv_server.log | head -2
  serve_as 8751 w3_as_kv_server --kv-cache-dtype fp8
  step w3_as_kv_warm 100 $SERVE_BENCH --base-url http://127.0.0.1:8751 --request-rate 16 --num-prompts 100
  TAIL=12 step w3_as_kv_fp8 100 $SERVE_BENCH --base-url http://127.0.0.1:8751 --request-rate 16 --output-json $OUT/w3_as_kv_fp8.json
  stop_server
}
p5_fp8() {
  TAIL=2 step sbs_as_fp8 200 python3 $SBS --engine asyncserve --workloads w2,w1b --model $L3 --quantization fp8
  TAIL=2 step sbs_vllm_fp8 300 env $VENV python3 $SBS --engine vllm --workloads w2,w1b --model $L3 --quantization fp8
}
p5_w4a16() {
  TAIL=2 step sbs_as_w4a16 150 python3 $SBS --engine asyncserve --workloads w2 --model benchmarks/configs/llama3-8b-w4a16
  TAIL=2 step sbs_vllm_w4a16 250 env $VENV python3 $SBS --engine vllm --workloads w2 --model benchmarks/configs/llama3-8b-w4a16
}

# --- part 6: the side-by-side runs of part 4, one per lane, shorter ----------------------------
p6_w1b() {
  TAIL=2 step sbs_as_w1b 120 python3 $SBS --engine asyncserve --workloads w1b --model $L3
  TAIL=2 step sbs_vllm_w1b 220 env $VENV python3 $SBS --engine vllm --workloads w1b --model $L3
}
p6_w4() {
  TAIL=2 step sbs_as_w4 100 python3 $SBS --engine asyncserve --workloads w4 --model benchmarks/configs/qwen3-0.6b
  TAIL=2 step sbs_vllm_w4 200 env $VENV python3 $SBS --engine vllm --workloads w4 --model benchmarks/configs/qwen3-0.6b
}
p6_lora() {
  TAIL=3 step lora_as_8 120 python3 benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_8.json
  TAIL=12 step lora_vllm_8 200 env $VENV python3 benchmarks/lora_throughput.py --engine vllm --num-adapters 8 --output-json $OUT/lora_vllm_8.json
}
p6_spec() { TAIL=30 step spec_vllm 320 env $VENV python3 benchmarks/spec_decode.py --engine vllm; }

echo "=== part $1 $(date +%T)"
case $1 in
  prep)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; command -v nsys
    lane 0 p1_w1b; lane 1 p1_start; lane 2,3 p1_tp2 ;;
  smol)
    cat /tmp/smol/part_a .smol/b/part > $SMOL && sha256sum $SMOL | cut -c1-64 | diff - .smol/b/sha256 && echo "SmolLM2 assembled"
    lane 0 p2_tests; lane 1 p2_spec; lane 2 p2_moe; lane 3 p2_llava ;;
  stage)
    bash .peer/p0/stage.sh | tail -1
    lane 0 p3_fp8; lane 1 p3_w1b; lane 2 p3_kv; lane 3 p3_w2fp8block_tests ;;
  side)
    bash .peer/p1/install.sh | tail -1
    lane 0 p4_lora; lane 1 p4_llava; lane 2 p4_w1b_w4; lane 3 p4_tests_spec ;;
  side2)
    lane 0 p5_w3; lane 1 p5_kv; lane 2 p5_fp8; lane 3 p5_w4a16 ;;
  side3)
    lane 0 p6_w1b; lane 1 p6_w4; lane 2 p6_lora; lane 3 p6_spec ;;
esac
finish $1
