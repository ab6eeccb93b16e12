#!/usr/bin/env bash
# The GPU measurements the open issues wait for, on one GPU or several: each part's job groups
# are dealt over the GPUs (group i on GPU i mod count; a GPU's jobs run in turn, first ones
# first), each job one engine or a pair run one after the other on the same GPU and inputs
# (asyncserve, then vLLM 0.26.0). On one GPU a part may not finish all its jobs in a call: the
# ones left at the deadline (540 s) are ended (run side2 next for the pairs side leaves).
# Here first: ../shared/peers/vllm/build.sh (.peer/), ../shared/device-wheels copied to .whl/,
# SmolLM2's GGUF split into .smol/a/part and .smol/b/part (+ .smol/b/sha256).
#   1 prep   carry .whl .smol/a: int4 and FP8 GEMV tests and microbenchmarks (issue 14);
#            LoRA with 8 adapters alone, with stack dumps (17); attention tiles at head dim
#            256 (Gemma 3) and PowerMoE W2/W1b with the one-launch expert sort (13)
#   2 smol   carry .smol/b: speculative decoding with verification graphs, tests (16); the
#            GPU test files; py-spy installed (its wheel in .smol/b) for the LoRA pair
#   3 stage  carry .peer/p0: vLLM part 0 staged
#   4 side   carry .peer/p1: vLLM installed; pairs: speculative decoding (16), W1b and W4
#            (18), W4A16 W2 (14), Gemma 3 W1b (13), FP8 W2/W1b (14), LoRA with 8 adapters (17)
#   5 side2  (warm, one GPU) pairs: LoRA with 8 adapters (17), FP8 W2/W1b (14)
#   6 moe    (warm, after side) carry .peer/moe: vLLM's MoE kernels (40 MB .so.xz, made here from
#            the vLLM wheel that build.sh downloads); PowerMoE-3b and Qwen3-30B-A3B pairs (13)
# Usage: bash benchmarks/gpu_pending.sh prep|smol|stage|side|side2|moe
source "$(dirname "$0")/gpu_lanes.sh"
GEMMA=benchmarks/configs/gemma3-4b
W4A16=benchmarks/configs/llama3-8b-w4a16
QWEN=benchmarks/configs/qwen3-0.6b

# deal GROUP...: each GROUP a quoted list of jobs for one GPU; group i goes to GPU i mod the GPU
# count (on fewer GPUs than groups, a GPU runs several groups one after another).
deal() {
  local count gpu i=0
  count=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$count" -ge 1 ] || count=1
  local -a per_gpu=()
  for group in "$@"; do gpu=$((i % count)); per_gpu[$gpu]="${per_gpu[$gpu]:-} $group"; i=$((i + 1)); done
  for gpu in "${!per_gpu[@]}"; do
    (export CUDA_VISIBLE_DEVICES=$gpu; for job in ${per_gpu[$gpu]}; do echo "--- $job $(date +%T)"; $job; done) > $OUT/lane_gpu$gpu.txt 2>&1 &
    LANES+=($!)
  done
}

# --- asyncserve alone ------------------------------------------------------------------
j_int4() {
  TAIL=6 step int4_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemv.py tests/kernels/test_int4_gemm.py tests/quantization/test_int4_checkpoints.py
  TAIL=30 step int4_gemv_bench 200 python3 benchmarks/int4_gemv_bench.py --sweep
  TAIL=12 step int4_gemv_bench_m4 100 python3 benchmarks/int4_gemv_bench.py --m 4
}
j_fp8_gemv() {
  TAIL=6 step fp8_gemv_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py tests/quantization/test_fp8_gpu.py
  TAIL=30 step fp8_gemv_bench 200 python3 benchmarks/fp8_gemv_bench.py --sweep
  TAIL=12 step fp8_gemv_bench_m4 100 python3 benchmarks/fp8_gemv_bench.py --m 4
}
j_powermoe() { TAIL=2 step powermoe_as 250 python3 $SBS --engine asyncserve --workloads w2,w1b --model benchmarks/configs/powermoe-3b; }
j_attn256() { TAIL=40 step attn_gemma 300 python3 benchmarks/bench_kernels.py --shape gemma3-4b --sweep; }
j_lora_alone() { TAIL=20 step lora_as_alone 300 python3 benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_alone.json; }
j_spec_tests() { ASYNCSERVE_TEST_GGUF=$SMOL TAIL=12 step spec_tests 300 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_verify_graphs.py tests/spec_decode/test_spec_gpu.py tests/spec_decode/test_proposer_graphs.py; }
j_spec_as() { TAIL=30 step spec_as 300 python3 benchmarks/spec_decode.py --gguf $SMOL; }
gpu_tests() { local name=$1; shift; ASYNCSERVE_TEST_GGUF=$SMOL TAIL=25 step $name 500 python3 -m pytest -q -p no:cacheprovider -rfs "$@"; }
j_gpu_tests_kernels() { gpu_tests gpu_tests_kernels tests/kernels; }
j_gpu_tests_engine() { gpu_tests gpu_tests_engine tests/engine/test_gpu_engine.py tests/engine/test_async_scheduling_gpu.py tests/worker; }
j_gpu_tests_quant() { gpu_tests gpu_tests_quant tests/quantization tests/lora/test_lora_gpu.py tests/models/test_sliding_window_kv.py; }

# --- pairs: asyncserve, then vLLM, same GPU ----------------------------------------------
pair() {  # pair NAME LIMIT_AS LIMIT_VLLM ARGS...: side_by_side.py with each engine
  local name=$1 la=$2 lv=$3; shift 3
  TAIL=2 step ${name}_as $la python3 $SBS --engine asyncserve "$@"
  TAIL=2 step ${name}_vllm $lv env $VENV python3 $SBS --engine vllm "$@"
}
j_w1b() { pair w1b 150 250 --workloads w1b --model $L3; }
j_w4() { pair w4 100 200 --workloads w4 --model $QWEN; }
j_w4a16() { pair w4a16 150 250 --workloads w2 --model $W4A16; }
j_gemma() { pair gemma 200 300 --workloads w1b --model $GEMMA; }
j_fp8() { pair fp8 200 300 --workloads w2,w1b --model $L3 --quantization fp8; }
j_spec_pair() {  # asyncserve first: it also writes the models and prompts vLLM reads
  j_spec_as
  TAIL=30 step spec_vllm 330 env $VENV python3 benchmarks/spec_decode.py --engine vllm
}
j_powermoe_pair() { pair powermoe 250 300 --workloads w2,w1b --model benchmarks/configs/powermoe-3b; }
# Qwen3-30B-A3B's 61 GB of bf16 weights fit an H100 with a small KV pool (the issue asks an H200).
j_qwen3moe_pair() { pair qwen3moe 300 300 --workloads w2,w1b --model benchmarks/configs/qwen3-30b-a3b; }
j_lora() {
  TAIL=3 step lora_as_8 300 python3 benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_8.json
  # vLLM's LoRA engine did not finish starting in 430 s twice: where its processes are at 240 s.
  (sleep 240; for pid in $(pgrep -f "engine vllm --num-adapters"); do
     /tmp/site/bin/py-spy dump --pid $pid --subprocesses; done > $OUT/lora_vllm_pyspy.txt 2>&1) &
  TAIL=12 step lora_vllm_8 300 env $VENV python3 benchmarks/lora_throughput.py --engine vllm --num-adapters 8 --output-json $OUT/lora_vllm_8.json
}

echo "=== part $1 $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $1 in
  prep)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a
    deal j_int4 j_fp8_gemv j_lora_alone "j_attn256 j_powermoe" ;;
  smol)
    cat /tmp/smol/part_a .smol/b/part > $SMOL && sha256sum $SMOL | cut -c1-64 | diff - .smol/b/sha256 && echo "SmolLM2 assembled"
    # py-spy (a wheel beside the GGUF's second part: .whl and .smol/a fill the first call)
    ls .smol/b/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .smol/b/*.whl
    deal j_spec_tests j_gpu_tests_kernels j_gpu_tests_engine j_gpu_tests_quant ;;
  stage)
    bash .peer/p0/stage.sh | tail -1 ;;
  side)
    bash .peer/p1/install.sh | tail -1
    deal j_spec_pair "j_w1b j_w4" "j_w4a16 j_gemma" "j_fp8 j_lora" ;;
  side2)
    deal "j_lora j_fp8" ;;
  moe)  # vLLM's MoE kernels (left out of the peer bundle) added to the installed vLLM
    xz -dc .peer/moe/moe.so.xz > /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so
    sha256sum /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so | cut -c1-64 | diff - .peer/moe/so.sha256 && echo "vLLM MoE kernels added"
    deal j_powermoe_pair j_qwen3moe_pair ;;
esac
finish $1
