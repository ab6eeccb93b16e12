#!/usr/bin/env bash
# GPU run I: the model families beside vLLM 0.26.0 (installed in /tmp/site_v), same call, same inputs
# (side_by_side.py: random token-id prompts from one seed, greedy, EOS ignored, dummy bf16 weights).
#   part moe:    MoE kernel tests; PowerMoE-3b shape W1b (1000 x 256/256) and W2 (batch 1, 128/256)
#   part gemma:  Gemma 3 4B shape W1b and W2
#   part qwen:   Qwen3-30B-A3B shape W2 and W4 (256 prompts, 100-1024 in / out)   [nvidia-h200]
# Usage: bash benchmarks/gpu_suite_i.sh PART SIDE_BY_SIDE_PY
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-i
OUT=${OUT:-/tmp/out}
SBS=$2
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee $OUT/$name.log | grep -e RESULT -e Error -e error -e passed -e failed | tail -${TAIL:-8}; }
as() { PYTHONPATH=/tmp/site:$PWD step "as_$1" $2 python3 $SBS --engine asyncserve "${@:3}"; }
vl() { PYTHONPATH=/tmp/site_v VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 step "vllm_$1" $2 python3 $SBS --engine vllm "${@:3}"; }
case $1 in
  moe)
    PYTHONPATH=/tmp/site:$PWD step moe_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels -k moe -rs
    M=benchmarks/configs/powermoe-3b
    as powermoe 200 --workloads w2,w1b --model $M
    vl powermoe 300 --workloads w2,w1b --model $M
    ;;
  gemma)
    M=benchmarks/configs/gemma3-4b
    as gemma 250 --workloads w2,w1b --model $M
    vl gemma 330 --workloads w2,w1b --model $M
    ;;
  qwen)
    M=benchmarks/configs/qwen3-30b-a3b
    as qwen 250 --workloads w2,w4 --model $M
    vl qwen 330 --workloads w2,w4 --model $M
    ;;
esac
grep -h RESULT $OUT/*.log > $OUT/results.jsonl
