#!/usr/bin/env bash
# The 2-GPU runs (nvidia-h200-x2), in four calls back to back (the machine keeps /tmp only
# while it stays warm). Results under $OUT. Here first: benchmarks/ray_wheels.sh (.raywhl/)
# and ../shared/peers/vllm/build.sh (.peer/); asyncserve's own wheels in .whl/.
#   1 tp      carry .raywhl/p0 .whl: asyncserve's wheels into /tmp/site, Ray part 0 staged;
#             TP=2 fp32 greedy equal to TP=1, 2-GPU tests, all-reduce latency (NCCL and the
#             one-shot kernel), logits gather, step broadcast, W1b DP=2 vs DP=1
#   2 ray     carry .raywhl/p1: Ray installed; Ray Data 2 replicas vs 1, Ray executor vs mp at TP=2
#   3 disagg  carry .peer/p0: vLLM part 0 staged; disaggregated prefill vs DP=2 serving 4096/256,
#             KV pull times over NCCL
#   4 vllm    carry .peer/p1: vLLM installed; W2 at TP=1 and TP=2 (one-shot all-reduce, NCCL only)
#             with asyncserve, then vLLM at TP=2, same prompts (side_by_side.py)
#   check     carry .whl: after fixes, on a fresh machine: disaggregated prefill vs DP=2 again,
#             TP=2 equality with the one-shot all-reduce, W2 start-up with every decode graph
#             captured at start, W1b, the GPU tests of the changed parts
# Usage: bash benchmarks/gpu_x2.sh tp|ray|disagg|vllm|check
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-x2 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site/starlette ] || { echo "asyncserve's wheels missing: run part tp (carry .whl) first"; exit 3; }
AS_PATH=/tmp/site:$PWD
step() { name=$1; limit=$2; shift 2; echo "=== $name $(date +%T)"; timeout $limit "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" -e "tokenizer.json" | tee $OUT/$name.log | tail -${TAIL:-6}; }
L3=benchmarks/configs/llama3-8b
SBS=benchmarks/side_by_side.py
case $1 in
  tp)
    bash .raywhl/p0/stage.sh | tail -1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -4
    export PYTHONPATH=$AS_PATH
    TAIL=3 step tests_2gpu 150 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_fast_all_reduce.py tests/disagg/test_kv_group_transport.py
    TAIL=30 step allreduce 90 python3 benchmarks/allreduce_latency.py --ranks 2 --hidden 4096 --output-json $OUT/allreduce.json
    TAIL=8 step tp_equality 200 python3 benchmarks/tp_equality.py --device cuda --output-json $OUT/tp_equality.json
    W1B="python3 -m asyncserve bench throughput --model $L3 --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --max-model-len 2048"
    TAIL=3 step w1b_dp1 120 $W1B --data-parallel-size 1 --output-json $OUT/w1b_dp1.json
    TAIL=3 step w1b_dp2 150 $W1B --data-parallel-size 2 --output-json $OUT/w1b_dp2.json
    TAIL=12 step logits_gather 60 python3 benchmarks/logits_gather.py --ranks 2 --vocab 128256 --output-json $OUT/logits_gather.json
    TAIL=4 step tp_broadcast 60 python3 benchmarks/tp_broadcast.py --ranks 2 --steps 500 --output-json $OUT/tp_broadcast.json
    ;;
  ray)
    bash .raywhl/p1/install.sh | tail -1
    export PYTHONPATH=/tmp/site_ray:$AS_PATH
    TAIL=12 step ray_data 230 python3 benchmarks/ray_bench.py data --model $L3 --out $OUT/ray_data.json
    TAIL=12 step ray_exec 300 python3 benchmarks/ray_bench.py executor --model $L3 --rounds 1 --iters 5 --out $OUT/ray_exec.json
    ;;
  disagg)
    bash .peer/p0/stage.sh | tail -1
    export PYTHONPATH=$AS_PATH
    TAIL=30 step disagg_serving 420 python3 benchmarks/disagg_serving.py --input-len 4096 --output-len 256 --num-prompts 200 --request-rate 5 --out $OUT
    TAIL=3 step disagg_pull 110 python3 benchmarks/disagg_bench.py --connector PyNcclConnector --num-requests 10 --out $OUT
    ;;
  vllm)
    bash .peer/p1/install.sh | tail -1
    as() { PYTHONPATH=$AS_PATH step "as_$1" $2 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --repeat 3 "${@:3}"; }
    as tp1 90
    as tp2 120 --tensor-parallel-size 2
    as tp2_nccl 120 --tensor-parallel-size 2 --disable-custom-all-reduce
    PYTHONPATH=/tmp/site_v VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
      step vllm_tp2 330 python3 $SBS --engine vllm --workloads w2 --model $L3 --repeat 3 --tensor-parallel-size 2
    ;;
  check)
    export PYTHONPATH=$AS_PATH
    TAIL=30 step disagg_serving 330 python3 benchmarks/disagg_serving.py --input-len 4096 --output-len 256 --num-prompts 200 --request-rate 5 --out $OUT
    TAIL=3 step disagg_pull 70 python3 benchmarks/disagg_bench.py --connector PyNcclConnector --num-requests 10 --out $OUT
    TAIL=8 step tp_equality 150 python3 benchmarks/tp_equality.py --device cuda --output-json $OUT/tp_equality.json
    TAIL=3 step tests_gpu 120 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_fast_all_reduce.py tests/worker/test_cuda_graphs_gpu.py tests/disagg/test_kv_group_transport.py
    TAIL=2 step as_tp1 60 python3 $SBS --engine asyncserve --workloads w2,w1b --model $L3
    TAIL=2 step as_tp2 80 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --repeat 3 --tensor-parallel-size 2
    ;;
esac
grep -h RESULT $OUT/*.log > $OUT/results.jsonl 2>/dev/null
echo "=== done $(date +%T)"
