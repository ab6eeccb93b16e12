#!/usr/bin/env bash
# GPU run LoRA (issue 17): the LoRA GPU tests, then W1b-style throughput with 8 rank-16
# adapters spread over the batch against the base model, asyncserve and vLLM 0.26.0
# (installed in /tmp/site_v by ../shared/peers/vllm), one JSON per run in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-lora
AS_PATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee $OUT/$name.log | tail -${TAIL:-8}; }
export PYTHONPATH=$AS_PATH
TAIL=6 step gpu_tests_lora 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora.py tests/lora -rs
B="python3 benchmarks/lora_throughput.py"
step lora_as_base 200 $B --engine asyncserve --num-adapters 0 --output-json $OUT/lora_as_base.json
step lora_as_8x16 250 $B --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_8x16.json
if [ -d /tmp/site_v ]; then
  export PYTHONPATH=/tmp/site_v:$AS_PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
  step lora_vllm_base 300 $B --engine vllm --num-adapters 0 --output-json $OUT/lora_vllm_base.json
  step lora_vllm_8x16 300 $B --engine vllm --num-adapters 8 --output-json $OUT/lora_vllm_8x16.json
fi
