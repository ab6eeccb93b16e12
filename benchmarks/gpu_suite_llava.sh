#!/usr/bin/env bash
# GPU run multimodal (issue 19): the multimodal tests, then a llava-1.5-7b-shaped model (dummy
# weights, one 576-token image per request, 200 requests) with asyncserve and vLLM 0.26.0
# (installed in /tmp/site_v by ../shared/peers/vllm), one JSON per run in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-llava
AS_PATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
step() { name=$1; limit=$2; shift 2; echo "=== $name"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee $OUT/$name.log | tail -${TAIL:-8}; }
export PYTHONPATH=$AS_PATH
TAIL=6 step gpu_tests_mm 300 python3 -m pytest -q -p no:cacheprovider tests/multimodal -rs
B="python3 benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy"
step llava_as 400 $B --engine asyncserve --output-json $OUT/llava_as.json
if [ -d /tmp/site_v ]; then
  export PYTHONPATH=/tmp/site_v:$AS_PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
  step llava_vllm 500 $B --engine vllm --output-json $OUT/llava_vllm.json
fi
