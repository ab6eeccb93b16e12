#!/usr/bin/env bash
# The GPU measurements the open issues wait for, on one GPU or several: each part's job groups
# are dealt over the GPUs (group i on GPU i mod count; a GPU's jobs run in turn, first ones
# first), each job one engine or a pair run one after the other on the same GPU and inputs
# (asyncserve, then vLLM 0.26.0). Jobs still running at the deadline (540 s) are ended.
# Here first: ../shared/peers/vllm/build.sh (.peer/), ../shared/device-wheels copied to .whl/,
# SmolLM2's GGUF split into .smol/a/part and .smol/b/part (+ .smol/b/sha256), vLLM's MoE
# kernels in .peer/moe. Calls back to back (the machine keeps /tmp ~30 s after a call):
#   1 prep   carry .whl: asyncserve's wheels; the int4 GEMV on the GPU (tests, then
#            benchmarks/int4_gemv_bench.py against its predecessor, with a tile sweep) (14);
#            a lone LLaVA request's kernels and a host + CUDA trace (19)
#   2 stage  carry .peer/p0: vLLM part 0 staged
#   3 mmtest carry .tinyllava: the image encoder's graphs tested; a lone LLaVA request's
#            phases (19)
#   4 side   carry .peer/p1: vLLM installed; the LLaVA pair; vLLM's lone requests' kernels and
#            trace (19)
#   Older parts, each on a machine of its own: smol (carry .smol/b after prep with .smol/a),
#   moe (carry .peer/moe after side), tp2, check (carry .whl), pairs (carry .peer/p1),
#   disagg, w1b_diag and syncs (carry .whl).
# Usage: bash benchmarks/gpu_pending.sh prep|stage|side|smol|moe|tp2|check|pairs|disagg|w1b_diag|syncs
source "$(dirname "$0")/gpu_lanes.sh"
QWEN=benchmarks/configs/qwen3-0.6b
QWEN3MOE=benchmarks/configs/qwen3-30b-a3b

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
gpu_tests() { local name=$1; shift; ASYNCSERVE_TEST_GGUF=$SMOL TAIL=25 step $name 500 python3 -m pytest -q -p no:cacheprovider -rfs "$@"; }
j_gpu_tests_kernels() { gpu_tests gpu_tests_kernels tests/kernels; }
j_gpu_tests_engine() {  # -s: the agreement figures the GPU tests print
  gpu_tests gpu_tests_engine -s tests/engine/test_gpu_engine.py tests/engine/test_gpu_agreement.py tests/engine/test_async_scheduling_gpu.py tests/worker
}
j_gpu_tests_quant() { gpu_tests gpu_tests_quant tests/quantization tests/lora/test_lora_gpu.py tests/models/test_sliding_window_kv.py; }
# W5 on the fresh machine: the first start compiles every kernel (its own Triton cache, which
# the other lanes do not fill), the second finds them cached (18).
j_cold_start() { TRITON_CACHE_DIR=/tmp/triton-cold TAIL=12 step w5 250 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 2 -- --max-model-len 2048; }
# W6: TTFT with and without prefix caching on 200 requests sharing a 2000-token prefix (18).
j_w6() { TAIL=6 step w6 200 python3 benchmarks/prefix_cache.py --model $L3; }
# Where a warm start's first seconds go (W5: 6 s before the loader's first line on the last
# H200 host): py-spy (wheel in .smol/b) samples the server until it answers.
j_w5_profile() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .spy/py_spy-*.whl || return
  (sleep 30; pkill -f "port 8702") &
  TAIL=2 step w5_spy 60 /tmp/spy/bin/py-spy record -r 100 -f raw -o $OUT/w5_spy.txt -- \
    python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702
}
j_spec_tests() { ASYNCSERVE_TEST_GGUF=$SMOL TAIL=12 step spec_tests 300 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_verify_graphs.py tests/spec_decode/test_spec_gpu.py tests/spec_decode/test_proposer_graphs.py; }

# --- pairs: asyncserve, then vLLM, same GPU ----------------------------------------------
# (`step` sets the global `name`: these functions keep theirs in `tag`.)
pair() {  # pair NAME LIMIT_AS LIMIT_VLLM ARGS...: side_by_side.py with each engine
  local tag=$1 la=$2 lv=$3; shift 3
  TAIL=2 step ${tag}_as $la python3 $SBS --engine asyncserve "$@"
  TAIL=2 step ${tag}_vllm $lv env $VENV python3 $SBS --engine vllm "$@"
}
# profiled_pair NAME ARGS...: the pair, then each engine again with its CUDA kernels summed per
# name over the timed run (vLLM's engine core in-process, so that the profiler sees it).
profiled_pair() {
  local tag=$1; shift
  pair $tag 150 250 "$@"
  TAIL=2 step ${tag}_as_kernels 150 python3 $SBS --engine asyncserve "$@" --kernel-summary $OUT/${tag}_as_kernels.tsv
  TAIL=2 step ${tag}_vllm_kernels 250 env $VENV VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 $SBS --engine vllm "$@" --kernel-summary $OUT/${tag}_vllm_kernels.tsv
}
j_w1b() {
  pair w1b 150 250 --workloads w1b --model $L3
  # A pool that holds all 1000 sequences (H200) runs them in one wave at 1024 sequences
  # (vLLM's offline default), with its decode steps captured as graphs up to 1024 (eager
  # above 512 otherwise).
  TAIL=2 step w1b_as_1024_graphs 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3 --max-num-seqs 1024 --max-cudagraph-capture-size 1024
}
j_w4() { pair w4 150 250 --workloads w4 --model $QWEN; }
j_gemma() { pair gemma 200 300 --workloads w1b --model benchmarks/configs/gemma3-4b; }
j_spec_pair() {  # asyncserve first: it also writes the models and prompts vLLM reads
  TAIL=30 step spec_as 300 python3 benchmarks/spec_decode.py --gguf $SMOL
  TAIL=30 step spec_vllm 330 env $VENV python3 benchmarks/spec_decode.py --engine vllm
}
# Qwen3-30B-A3B: W4 is the issue's 256-prompt throughput workload.
j_qwen3moe() { pair qwen3moe 250 300 --workloads w2,w4 --model $QWEN3MOE; }
# The attention kernel against vLLM's FlashAttention 3 on W4- and W1b-shaped batches (18).
j_attn_fa3() { TAIL=40 step attn_fa3 200 env $VENV python3 benchmarks/attention_vs_fa3.py; }
j_tp1() { pair tp1 150 200 --workloads w2 --model $L3; }
j_tp2() { pair tp2 200 250 --workloads w2 --model $L3 --tensor-parallel-size 2; }
# vLLM's LoRA engine core (its own process) stopped after "Using V2 Model Runner" in every
# run (2026-11-23, -27, -28); in-process it loads, compiles and goes on (2026-11-28).
j_lora() {
  TAIL=3 step lora_as_8 250 python3 benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8 --output-json $OUT/lora_as_8.json
  TAIL=12 step lora_vllm_8 400 env $VENV VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/lora_throughput.py --engine vllm --num-adapters 8 --output-json $OUT/lora_vllm_8.json
}
# vLLM's LLaVA imports a transformers name that the image's transformers renamed (peer_shims/).
j_llava() {
  TAIL=3 step llava_as 200 python3 benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy --engine asyncserve --output-json $OUT/llava_as.json
  TAIL=30 step llava_vllm 300 env $VENV PYTHONPATH=$PWD/benchmarks/peer_shims:/tmp/site_v:$AS python3 benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy --engine vllm --output-json $OUT/llava_vllm.json
}
# A lone LLaVA request: its kernels against its wall time, and a host + CUDA trace (19).
LLAVA_SINGLES="benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy --num-prompts 16 --output-len 8"
j_llava_single_as() {
  TAIL=3 step llava_single_as 200 python3 $LLAVA_SINGLES --engine asyncserve --singles-profile $OUT/llava_single_as.tsv --singles-trace $OUT/llava_single_as.json.gz --output-json $OUT/llava_single_as.json
}
j_llava_single_vllm() {
  TAIL=3 step llava_single_vllm 300 env $VENV VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$PWD/benchmarks/peer_shims:/tmp/site_v:$AS python3 $LLAVA_SINGLES --engine vllm --singles-profile $OUT/llava_single_vllm.tsv --singles-trace $OUT/llava_single_vllm.json.gz --output-json $OUT/llava_single_vllm.json
}
# The int4 GEMV: GPU tests, then against its predecessor and bf16, one token and four (14).
j_int4() {
  TAIL=4 step int4_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/quantization -k "int4 or gptq or awq or w4a16"
  TAIL=8 step int4_gemv_m1 200 python3 benchmarks/int4_gemv_bench.py --sweep
  TAIL=6 step int4_gemv_m4 100 python3 benchmarks/int4_gemv_bench.py --m 4
}
j_lone() {
  TAIL=1 step lone_641 150 python3 benchmarks/lone_prefill.py --input-len 641
  TAIL=1 step lone_64 150 python3 benchmarks/lone_prefill.py --input-len 64
}
j_encoder_graph_tests() { ASYNCSERVE_TEST_TINY_LLAVA=/tmp/tinyllava TAIL=4 step encoder_graph_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/multimodal/test_encoder_graphs_gpu.py; }
j_llava_phases() { TAIL=2 step llava_phases 200 python3 benchmarks/llava_phases.py --reps 20; }
# W1b at asyncserve's default (512 sequences) and at 1024 with graphs up to 1024, one GPU.
j_w1b_as_graphs() {
  TAIL=1 step w1b_as_512 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3
  TAIL=1 step w1b_as_1024_graphs 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3 --max-num-seqs 1024 --max-cudagraph-capture-size 1024
}
j_w4a16_pair() { pair w4a16 150 250 --workloads w2 --model benchmarks/configs/llama3-8b-w4a16; }
# The LLaVA burst's kernels, each engine (vLLM's engine core in-process): where 0.77x comes from.
j_llava_kernels() {
  TAIL=3 step llava_as_kernels 200 python3 benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy --engine asyncserve --kernel-summary $OUT/llava_as_kernels.tsv
  TAIL=3 step llava_vllm_kernels 300 env $VENV VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$PWD/benchmarks/peer_shims:/tmp/site_v:$AS python3 benchmarks/llava_bench.py --model-dir /tmp/llava-7b-dummy --engine vllm --kernel-summary $OUT/llava_vllm_kernels.tsv
}

# Since the last run: the kernels that must compile on the GPU (Gemma's activation, attention
# compiled once for any sequence count, MoE tiles), and W4 on a fresh Triton cache then a warm
# one (no kernel compiles mid-run any more: both should match).
j_kernel_checks() {
  TAIL=6 step kernel_checks 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_activation.py tests/kernels/test_kernels_gpu.py tests/kernels/test_moe.py tests/kernels/test_moe_align.py
}
j_w4_cold_warm() {
  TRITON_CACHE_DIR=/tmp/triton-w4 TAIL=1 step w4_fresh_cache 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN
  TRITON_CACHE_DIR=/tmp/triton-w4 TAIL=1 step w4_warm_cache 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN
}
j_w4_pair() { pair w4 150 250 --workloads w4 --model $QWEN; }

# W1b at 512 and 1024 sequences: kernels per name over the run, and a decode step's phases.
w1b_diag() {
  local seqs=$1
  TAIL=2 step w1b_${seqs}_kernels 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3 --max-num-seqs $seqs --kernel-summary $OUT/w1b_${seqs}_kernels.tsv
  TAIL=45 step phases_${seqs} 150 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size $((seqs < 1000 ? seqs : 1000)) --input-len 256 --output-len 128 --max-num-seqs $seqs --no-detokenize
}
j_w1b_diag_512() { w1b_diag 512; }
j_w1b_diag_1024() { w1b_diag 1024; }

echo "=== part $1 $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# w5 CACHE NAME: one W5 start on Triton cache /tmp/tc-CACHE, its log $OUT/w5_NAME.log; wb: the
# same with the last commit's package (.base/asyncserve: `git archive HEAD asyncserve | tar -x
# -C .base`; python -m puts the working directory first on the path, so it runs from .base).
w5() { TRITON_CACHE_DIR=/tmp/tc-$1 TAIL=1 step w5_$2 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 1 -- --max-model-len 2048; }
wb() { (cd .base && TRITON_CACHE_DIR=/tmp/tc-$1 TAIL=1 step w5_$2 100 python3 ../benchmarks/cold_start.py --model ../$L3 --port 8701 --repeat 1 -- --max-model-len 2048); }
# torch_bytecode: the bytecode a pip install leaves, compiled once into /tmp/pyc and read from
# there (this image ships torch without .pyc and sets PYTHONDONTWRITEBYTECODE, so every start
# compiled torch's sources: 4-5 s of imports; asyncserve's own, ~400 modules, 0.5-0.9 s).
torch_bytecode() {
  local d
  d=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  [ -d /tmp/pyc ] || env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -m compileall -q -j 16 $d/torch $d/triton $d/transformers $d/numpy $d/jinja2 /tmp/site > /dev/null 2>&1
  # asyncserve's own modules too (this tree's and .base's), as pip leaves them
  env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -m compileall -q -j 16 $PWD/asyncserve $(ls -d $PWD/.base/asyncserve 2>/dev/null) > /dev/null 2>&1
  export PYTHONPYCACHEPREFIX=/tmp/pyc
}

# variants_best: each shape's best tile per variant in $OUT/gemm_variants.log (int4_gemm_bench.py
# --variants): (n, k, m, variant) ms block_m block_n warps stages rel_err.
variants_best() {
  grep -h '"variant"' $OUT/gemm_variants.log | python3 -c "
import json, sys
rows = [r for r in (json.loads(l) for l in sys.stdin if l.startswith('{')) if 'ms' in r]
best = {}
for r in rows:
    key = (r['n'], r['k'], r['m'], r['variant'])
    if key not in best or r['ms'] < best[key]['ms']:
        best[key] = r
for key in sorted(best):
    c = best[key]['config']
    print(key, best[key]['ms'], c['block_m'], c['block_n'], c['num_warps'], c['num_stages'], best[key]['rel_err'])
"
}

# w3_kv NAME KV: W3 at 16 req/s on a server with --kv-cache-dtype KV (100 warm-up requests
# first; 1024 sequences, so that max_num_seqs x max_model_len does not cap an fp8 pool), its
# TTFT / TPOT / ITL figures printed on one line (14).
w3_kv() {
  local run=$1 kv=$2
  serve_as 8720 w3_server_$run --kv-cache-dtype $kv --max-num-seqs 1024
  step w3_warm_$run 150 $SERVE_BENCH --base-url http://127.0.0.1:8720 --request-rate 16 --num-prompts 100
  TAIL=1 step w3_kv_$run 150 $SERVE_BENCH --base-url http://127.0.0.1:8720 --request-rate 16 --output-json $OUT/w3_kv_$run.json
  stop_server
  python3 -c "import json; d = json.load(open('$OUT/w3_kv_$run.json')); print('$run', *(f'{k} {d[k]:.2f}' for k in ('median_ttft_ms', 'p99_ttft_ms', 'median_tpot_ms', 'p99_tpot_ms', 'median_itl_ms')))"
}

case $1 in
  prep)
    [ -d .smol/a ] && mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a
    deal j_int4 j_llava_single_as ;;
  stage)
    bash .peer/p0/stage.sh | tail -1 ;;
  mmtest)  # carry .tinyllava (tests/multimodal/tiny_llava.py's checkpoint, built here)
    rm -rf /tmp/tinyllava && cp -r .tinyllava /tmp/tinyllava
    deal "j_encoder_graph_tests j_llava_phases" ;;
  side)
    bash .peer/p1/install.sh | tail -1
    deal j_llava "j_llava_phases j_llava_single_vllm" ;;
  side2)  # carry .peer/p1 after stage: the LLaVA pair again, and lone text prompts (19)
    bash .peer/p1/install.sh | tail -1
    deal j_llava j_lone ;;
  smol)
    cat /tmp/smol/part_a .smol/b/part > $SMOL && sha256sum $SMOL | cut -c1-64 | diff - .smol/b/sha256 && echo "SmolLM2 assembled"
    deal j_gpu_tests_engine j_gpu_tests_quant j_spec_tests ;;
  moe)  # vLLM's MoE kernels (left out of the peer bundle) added to the installed vLLM
    xz -dc .peer/moe/moe.so.xz > /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so
    sha256sum /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so | cut -c1-64 | diff - .peer/moe/so.sha256 && echo "vLLM MoE kernels added"
    deal j_qwen3moe "j_attn_fa3 j_tp1"
    if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
      (export CUDA_VISIBLE_DEVICES=2,3; j_tp2) > $OUT/lane_tp2.txt 2>&1 &
      LANES+=($!)
    fi ;;
  tp2)  # on a 2-GPU host, after moe (its vLLM installed)
    (export CUDA_VISIBLE_DEVICES=0,1; j_tp2) > $OUT/lane_tp2.txt 2>&1 &
    LANES+=($!) ;;
  probe)  # carry .whl: a lone LLaVA request's phases (19); W1b with graphs up to 1024 (18)
    deal "j_llava_phases j_llava_single_as" j_w1b_as_graphs ;;
  lone)  # carry .whl .spy: where a lone prefill's host time goes (19: a lone request's TTFT)
    python3 -m pip install -q --no-index --no-deps --target /tmp/spy .spy/py_spy-*.whl
    TAIL=1 step lone_641 150 python3 benchmarks/lone_prefill.py --input-len 641
    TAIL=1 step lone_64 150 python3 benchmarks/lone_prefill.py --input-len 64
    TAIL=2 step lone_spy 200 /tmp/spy/bin/py-spy record -r 1000 --native --idle --threads -f raw -o $OUT/lone_spy.txt -- python3 benchmarks/lone_prefill.py --input-len 641 --num-requests 150 ;;
  graphs)  # carry .whl .tinyllava: the prefill and image encoder graphs on the GPU; lone prompts
    rm -rf /tmp/tinyllava && cp -r .tinyllava /tmp/tinyllava
    ASYNCSERVE_TEST_TINY_LLAVA=/tmp/tinyllava TAIL=4 step graph_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_prefill_graphs.py tests/worker/test_cuda_graphs_gpu.py tests/multimodal/test_encoder_graphs_gpu.py
    TAIL=1 step lone_641 100 python3 benchmarks/lone_prefill.py --input-len 641
    TAIL=1 step lone_64 100 python3 benchmarks/lone_prefill.py --input-len 64 ;;
  coldpar)  # carry .whl: W5 with start-up kernels compiled on threads against one at a time,
    # each first on a fresh Triton cache, then again on the cache it filled (18); greedy
    # tokens after each (dense and MoE) and the graph tests, through the compile pass
    for round in 1 2; do
      for state in cold warm; do
        ASYNCSERVE_COMPILE_THREADS=1 TRITON_CACHE_DIR=/tmp/tc-s$round TAIL=1 step w5_one_${round}_$state 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 1 -- --max-model-len 2048
        TRITON_CACHE_DIR=/tmp/tc-t$round TAIL=1 step w5_threads_${round}_$state 100 python3 benchmarks/cold_start.py --model $L3 --port 8702 --repeat 1 -- --max-model-len 2048
      done
    done
    grep -h "compiled .* kernel variants\|compiled after start-up" $OUT/w5_threads_1_*.log | cut -c1-160
    for model in $L3 benchmarks/configs/powermoe-3b; do
      n=$(basename $model)
      ASYNCSERVE_COMPILE_THREADS=1 TRITON_CACHE_DIR=/tmp/tc-c1-$n TAIL=1 step check_one_$n 120 python3 benchmarks/compile_threads_check.py --model $model
      TRITON_CACHE_DIR=/tmp/tc-c2-$n TAIL=1 step check_threads_$n 120 python3 benchmarks/compile_threads_check.py --model $model
      grep -h "compiled .* kernel variants\|compiled after start-up" $OUT/check_threads_$n.log | cut -c1-160
    done
    TRITON_CACHE_DIR=/tmp/tc-tests TAIL=4 step graph_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_prefill_graphs.py tests/worker/test_cuda_graphs_gpu.py tests/worker/test_verify_graphs.py tests/kernels/test_parallel_compiles.py ;;
  coldpar2)  # carry .whl: W5 pairs as coldpar (threads first in the second round); graph tests
    ASYNCSERVE_COMPILE_THREADS=1 w5 s1 one_1_cold; w5 t1 threads_1_cold
    ASYNCSERVE_COMPILE_THREADS=1 w5 s1 one_1_warm; w5 t1 threads_1_warm
    w5 t2 threads_2_cold; ASYNCSERVE_COMPILE_THREADS=1 w5 s2 one_2_cold
    w5 t2 threads_2_warm; ASYNCSERVE_COMPILE_THREADS=1 w5 s2 one_2_warm
    grep -h "compiled .* kernel variants\|compiled after start-up\|GPU memory\|captured\|loaded" $OUT/w5_threads_*_cold.log | cut -c1-150
    TRITON_CACHE_DIR=/tmp/tc-tests TAIL=2 step graph_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_prefill_graphs.py tests/worker/test_cuda_graphs_gpu.py tests/kernels/test_parallel_compiles.py ;;
  coldfork)  # carry .whl: W5 with start-up compiles in children forked from the threads
    # against on the threads (ASYNCSERVE_COMPILE_FORK=0), pairs on fresh caches then warm,
    # order swapped in round 2 (18); greedy tokens both ways (dense and MoE); graph tests
    w5 f1 fork_1_cold; ASYNCSERVE_COMPILE_FORK=0 w5 t1 threads_1_cold
    w5 f1 fork_1_warm; ASYNCSERVE_COMPILE_FORK=0 w5 t1 threads_1_warm
    ASYNCSERVE_COMPILE_FORK=0 w5 t2 threads_2_cold; w5 f2 fork_2_cold
    ASYNCSERVE_COMPILE_FORK=0 w5 t2 threads_2_warm; w5 f2 fork_2_warm
    grep -h "compiled .* kernel variants\|compiled after start-up\|loader's first\|answering" $OUT/w5_*_cold.log | cut -c1-160
    for model in $L3 benchmarks/configs/powermoe-3b; do
      n=$(basename $model)
      ASYNCSERVE_COMPILE_FORK=0 TRITON_CACHE_DIR=/tmp/tc-c1-$n TAIL=1 step check_threads_$n 120 python3 benchmarks/compile_threads_check.py --model $model
      TRITON_CACHE_DIR=/tmp/tc-c2-$n TAIL=1 step check_fork_$n 120 python3 benchmarks/compile_threads_check.py --model $model
      grep -h "compiled .* kernel variants\|compiled after start-up" $OUT/check_*_$n.log | cut -c1-160
      diff <(tail -1 $OUT/check_threads_$n.log | sed 's/.*"tokens"//') <(tail -1 $OUT/check_fork_$n.log | sed 's/.*"tokens"//') > /dev/null && echo "$n: same tokens" || echo "$n: TOKENS DIFFER"
    done
    TRITON_CACHE_DIR=/tmp/tc-tests TAIL=2 step graph_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_prefill_graphs.py tests/worker/test_cuda_graphs_gpu.py tests/kernels/test_parallel_compiles.py tests/kernels/test_compile_child.py ;;
  colddiag)  # carry .whl: where W5's cold start goes (18): imports of the serve path
    # (-X importtime, top cumulative), then a cold start at DEBUG: each kernel's compile and
    # load time in the start-up pass, forked children then threads
    python3 -X importtime -c "import asyncserve.cli, asyncserve.cli_server, asyncserve.engine.setup, asyncserve.worker.model_runner, asyncserve.engine.async_engine, asyncserve.http.app" 2> $OUT/importtime.txt
    sort -t'|' -k2 -n -r $OUT/importtime.txt | head -45 | cut -c1-110
    for mode in 1 0; do
      ASYNCSERVE_LOG_LEVEL=DEBUG ASYNCSERVE_COMPILE_FORK=$mode TRITON_CACHE_DIR=/tmp/tc-d$mode TAIL=1 step w5_debug_$mode 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 1 -- --max-model-len 2048
      grep -h "kernel .*compiled in\|compiled .* kernel variants\|loader's first\|answering\|loaded \|captured" $OUT/w5_debug_$mode.log | cut -c1-200
    done ;;
  pyc)  # carry .whl: is torch's import (5+ s on some hosts) compiling its sources? (18)
    d=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")
    echo "$d: $(ls $d/__pycache__ 2>/dev/null | wc -l) cached modules; writable: $(test -w $d && echo yes || echo no)"
    t='import time; t = time.perf_counter(); import torch; print(f"{time.perf_counter() - t:.2f} s: import torch")'
    for i in 1 2; do python3 -c "$t"; done
    for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$t"; done
    python3 -X importtime -c "import torch" 2> $OUT/torch_importtime.txt; sort -t'|' -k2 -n -r $OUT/torch_importtime.txt | head -12 | cut -c1-100 ;;
  coldpyc)  # carry .whl .base: W5 from empty caches (and warm), this tree against the last
    # commit's package (wb), order swapped between rounds, with torch_bytecode first; whether
    # CUDA's start overlaps the imports on a thread (18)
    torch_bytecode
    t='import time; t = time.perf_counter(); import torch; print(f"{time.perf_counter() - t:.2f} s: import torch")'
    python3 -c "$t"; python3 -c "$t"
    r=$RANDOM  # caches of their own even on a machine an earlier call left warm
    w5 p1$r new_1_cold; wb q1$r base_1_cold
    wb q2$r base_2_cold; w5 p2$r new_2_cold
    w5 p3$r new_3_cold; wb q3$r base_3_cold
    w5 p3$r new_3_warm; wb q3$r base_3_warm
    TRITON_CACHE_DIR=/tmp/tc-t$r TAIL=2 step graph_tests 100 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_cuda_graphs_gpu.py tests/worker/test_gemm_warm_up.py tests/worker/test_prefill_graphs.py tests/worker/test_verify_graphs.py tests/kernels/test_parallel_compiles.py tests/kernels/test_compile_child.py tests/kernels/test_kernels_gpu.py::test_grammar_mask_compiles_only_at_warm_up
    for f in $OUT/w5_*.log; do echo "$(basename $f): $(grep -h "loader's first\|cold start to" $f | tr '\n' ' ') $(grep -h "compiled .* kernel variants" $f | grep -o "children) in [0-9.]* s") ready at $(grep -h "engine ready" $f | cut -c2-7)"; done
    for mode in "" --thread "" --thread; do python3 benchmarks/cuda_init_overlap.py $mode; done ;;
  coldtl)  # carry .whl: W5's phases (18): each log line of a start after its seconds since the
    # start (cold_start.py), at DEBUG, two starts from empty caches and one warm, bytecode first
    torch_bytecode
    r=$RANDOM
    for run in c1 c2 c2; do
      ASYNCSERVE_LOG_LEVEL=DEBUG TRITON_CACHE_DIR=/tmp/tc-$run$r TAIL=1 step w5_tl_$run 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 1 -- --max-model-len 2048
      grep -v "compiled in\|loaded in" $OUT/w5_tl_$run.log | cut -c1-190
    done ;;
  coldprof)  # carry .whl: W5's phases (18): a start from an empty cache at DEBUG (app build and
    # the heap freeze timed), a warm start under cProfile (main thread; top cumulative), the
    # first CUDA and cuBLAS calls on the main thread with and without a thread before them
    torch_bytecode
    r=$RANDOM
    ASYNCSERVE_LOG_LEVEL=DEBUG TRITON_CACHE_DIR=/tmp/tc-p$r TAIL=1 step w5_cold 100 python3 benchmarks/cold_start.py --model $L3 --port 8701 --repeat 1 -- --max-model-len 2048
    grep -v "compiled in\|loaded in\|captured a graph" $OUT/w5_cold.log | cut -c1-190
    TRITON_CACHE_DIR=/tmp/tc-p$r python3 -m cProfile -o /tmp/warm.prof -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8702 > $OUT/w5_prof.log 2>&1 &
    wait_up 8702; curl -s localhost:8702/v1/completions -H 'content-type: application/json' -d '{"prompt": [1, 2], "max_tokens": 1}' | cut -c1-80; echo
    pkill -INT -f "port 8702"; sleep 8
    python3 -c "import pstats; s = pstats.Stats('/tmp/warm.prof'); s.sort_stats('cumulative').print_stats(90)" | cut -c1-170 | tail -100
    python3 -c "import pstats; s = pstats.Stats('/tmp/warm.prof'); s.sort_stats('tottime').print_stats(30)" | cut -c1-170 | tail -36
    for mode in "" --thread; do python3 benchmarks/cuda_init_overlap.py $mode; done ;;
  moetune)  # carry .whl: the fused MoE's tiles tuned on this GPU for Qwen3-30B-A3B (13; the
    # H200 read the H100's table); kept in /tmp/moe_cfg for the calls after, which copy it into
    # asyncserve/kernels/moe_configs/ (and so should this checkout, from $OUT/moe_configs)
    TAIL=6 step tune_moe 540 python3 benchmarks/tune_moe.py --models qwen3-30b-a3b --out $OUT --quick
    rm -rf /tmp/moe_cfg && cp -r $OUT/moe_configs /tmp/moe_cfg ;;
  moestage)  # carry .peer/p0 after moetune: vLLM staged; asyncserve's W4 kernels on Qwen3-30B-A3B
    bash .peer/p0/stage.sh | tail -1
    cp /tmp/moe_cfg/* asyncserve/kernels/moe_configs/
    TAIL=2 step qwen3moe_as_kernels 400 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN3MOE --kernel-summary $OUT/qwen3moe_as_kernels.tsv ;;
  moeinstall)  # carry .peer/p1 after moestage
    bash .peer/p1/install.sh | tail -1 ;;
  moepair)  # carry .peer/moe after moeinstall: vLLM's MoE kernels added; the Qwen3-30B-A3B pairs
    xz -dc .peer/moe/moe.so.xz > /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so
    sha256sum /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so | cut -c1-64 | diff - .peer/moe/so.sha256 && echo "vLLM MoE kernels added"
    cp /tmp/moe_cfg/* asyncserve/kernels/moe_configs/
    j_qwen3moe ;;
  install)  # carry .peer/p1 after stage
    bash .peer/p1/install.sh | tail -1 ;;
  moealign)  # carry .peer/moe .whl after install: the chunked expert sort on the GPU (its tests
    # and the fused MoE's), then the Qwen3-30B-A3B pairs (13)
    xz -dc .peer/moe/moe.so.xz > /tmp/site_v/vllm/_moe_C_stable_libtorch.abi3.so
    TAIL=3 step moe_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_moe_align.py tests/kernels/test_moe.py
    j_qwen3moe ;;
  moevllm)  # after moepair: vLLM's W4 kernels on Qwen3-30B-A3B
    TAIL=2 step qwen3moe_vllm_kernels 400 env $VENV VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 $SBS --engine vllm --workloads w4 --model $QWEN3MOE --kernel-summary $OUT/qwen3moe_vllm_kernels.tsv ;;
  coldtp)  # carry .whl; 2 GPUs: the start-up compile pass under tensor parallelism (18)
    for model in $L3 benchmarks/configs/powermoe-3b; do
      n=$(basename $model)
      ASYNCSERVE_COMPILE_THREADS=1 TRITON_CACHE_DIR=/tmp/tc-p1-$n TAIL=1 step tp_one_$n 150 python3 benchmarks/compile_threads_check.py --model $model --tensor-parallel-size 2
      TRITON_CACHE_DIR=/tmp/tc-p2-$n TAIL=1 step tp_threads_$n 150 python3 benchmarks/compile_threads_check.py --model $model --tensor-parallel-size 2
      grep -h "compiled .* kernel variants\|compiled after start-up" $OUT/tp_threads_$n.log | cut -c1-160
    done ;;
  coldspy)  # carry .whl .spy: W5 on fresh caches (ROUNDS, default "1 2"; empty for none), then
    # py-spy over a cold start until the server answers: main thread and compile threads,
    # where its time goes (18); BYTECODE=1: torch_bytecode first
    [ "${BYTECODE:-0}" = 1 ] && torch_bytecode
    for round in ${ROUNDS-1 2}; do
      TRITON_CACHE_DIR=/tmp/tc-u$round-$RANDOM TAIL=3 step w5_threads_$round 100 python3 benchmarks/cold_start.py --model $L3 --port 8702 --repeat 1 -- --max-model-len 2048
      grep -h "compiled .* kernel variants\|compiled after start-up\|captured\|GPU memory\|loading" $OUT/w5_threads_$round.log | cut -c1-160
    done
    python3 -m pip install -q --no-index --no-deps --target /tmp/spy .spy/py_spy-*.whl || exit 1
    ASYNCSERVE_LOG_LEVEL=DEBUG TRITON_CACHE_DIR=/tmp/tc-spy-$RANDOM /tmp/spy/bin/py-spy record -r 200 --idle --threads -f raw -o $OUT/w5_spy.txt -- \
      python3 -m asyncserve serve --model $L3 --load-format dummy --max-model-len 2048 --port 8703 > $OUT/w5_spy.log 2>&1 &
    wait_up 8703; sleep 1; pkill -INT -f "port 8703"; sleep 8
    grep -h "compiled .* kernel variants\|loaded Llama\|captured [0-9]\|engine ready\|GEMM warm-up" $OUT/w5_spy.log | cut -c1-200 ;;
  int4)  # carry .whl: the int4 GEMV without int-to-float conversions on the GPU (tests, against
    # its predecessor with a tile sweep, one token and four), then W2 W4A16 alone with its
    # kernels summed (14)
    j_int4
    TAIL=2 step w4a16_as_kernels 200 python3 $SBS --engine asyncserve --workloads w2 --model benchmarks/configs/llama3-8b-w4a16 --kernel-summary $OUT/w4a16_as_kernels.tsv ;;
  gemvstages)  # carry .whl: the int4 and FP8 GEMVs with their loops' loads pipelined
    # (tl.range num_stages; tests, then each shape's default tile's neighbours at depths 1-4) (14)
    command -v ncu nsys
    TAIL=4 step gemv_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_fp8_gemv.py
    TAIL=8 step int4_stages_m1 240 python3 benchmarks/int4_gemv_bench.py --sweep --narrow --stages 1,2,3,4
    grep best $OUT/int4_stages_m1.log
    TAIL=8 step fp8_stages_m1 200 python3 benchmarks/fp8_gemv_bench.py --sweep --narrow --stages 1,2,3,4
    grep best $OUT/fp8_stages_m1.log ;;
  gemvncu)  # carry .whl: Nsight Compute on the int4 and FP8 GEMVs (gate_up, one token; what
    # bounds the int4 GEMV) (14); a W4-sized model's decode step phases at 256 and 24 sequences (18)
    timeout 200 ncu --kernel-name regex:gemv_kernel --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
      --section SourceCounters python3 benchmarks/gemv_ncu.py > $OUT/gemv_ncu.txt 2>&1
    grep -E "^  _|Throughput|Duration|Issue|Stall|Warp Cycles|Occupancy|Registers|Pipe|Executed Ipc|Eligible" $OUT/gemv_ncu.txt | head -80
    for b in 256 24; do
      TAIL=40 step phases_qwen_$b 150 python3 benchmarks/step_phases.py --model $QWEN --load-format dummy --batch-size $b --input-len 512 --output-len 128 --no-detokenize
    done ;;
  fuse)  # carry .whl .base (`git archive HEAD asyncserve benchmarks | tar -x -C .base`): rotary
    # fused with the KV store (and Qwen3's q/k norms) on the GPU: tests, then a W4-sized model's
    # decode steps and W4 itself, this tree against the last commit's, alternating (18)
    TAIL=4 step fuse_tests 300 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_rope_store.py tests/kernels/test_rope.py tests/kernels/test_kv_store.py tests/kernels/test_fp8_kv.py tests/kernels/test_kernels_gpu.py tests/models/test_families_gpu.py
    for b in 24 256; do
      TAIL=3 step phases_new_$b 150 python3 benchmarks/step_phases.py --model $QWEN --load-format dummy --batch-size $b --input-len 512 --output-len 128 --no-detokenize
      (cd .base && TAIL=3 step phases_base_$b 150 python3 benchmarks/step_phases.py --model $QWEN --load-format dummy --batch-size $b --input-len 512 --output-len 128 --no-detokenize)
    done
    for r in 1 2; do
      TAIL=1 step w4_new_$r 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN
      (cd .base && TAIL=1 step w4_base_$r 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN)
    done ;;
  w4prof)  # carry .whl: W4 with its kernels summed and the device's busy time over the run
    # (where it idles), this tree, then the same for Llama-3-8B's W1b (18)
    TAIL=25 step w4_as_prof 200 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN --kernel-summary $OUT/w4_as_kernels.tsv
    cat $OUT/w4_as_kernels.tsv | head -30; grep "^#" $OUT/w4_as_kernels.tsv
    TAIL=2 step w1b_as_prof 200 python3 $SBS --engine asyncserve --workloads w1b --model $L3 --kernel-summary $OUT/w1b_as_kernels.tsv
    grep "^#" $OUT/w1b_as_kernels.tsv ;;
  gcab)  # carry .whl .base (the commit before the GC freeze and the rotary-store fusion): W1b,
    # this tree against .base alternating, then this tree profiled (device idle, GC pauses) (18)
    for r in 1 2; do
      TAIL=2 step w1b_new_$r 200 python3 $SBS --engine asyncserve --workloads w1b --model $L3
      (cd .base && TAIL=1 step w1b_base_$r 200 python3 $SBS --engine asyncserve --workloads w1b --model $L3)
    done
    TAIL=2 step w1b_new_prof 200 python3 $SBS --engine asyncserve --workloads w1b --model $L3 --kernel-summary $OUT/w1b_new_kernels.tsv
    grep "^#" $OUT/w1b_new_kernels.tsv ;;
  pairs2)  # carry .peer/p1 after stage: the W4 and W1b pairs (18)
    bash .peer/p1/install.sh | tail -1
    j_w4_pair
    pair w1b 150 300 --workloads w1b --model $L3 ;;
  splitsregs)  # carry .whl: the LM head's fp32 GEMM tested; attention split factors on W4's
    # ragged decode batches (18); the int4 GEMV under register caps (14)
    TAIL=4 step logits_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/models/test_layers.py tests/kernels/test_int4_gemv.py tests/kernels/test_fp8_gemv.py
    TAIL=120 step attn_splits 240 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --splits --ragged --no-mixed --decode 32x1400,64x1300,96x1200,128x1100,192x1000,256x900
    TAIL=8 step int4_regs 280 python3 benchmarks/int4_gemv_bench.py --sweep --narrow --maxnreg 0,40,48,56
    grep best $OUT/int4_regs.log ;;
  wideab)  # carry .whl .base (the commit before the LM head's fp32 GEMM; ran on a tree with
    # 128-key decode tiles, not kept): attention tests and decode shapes on the GPU, then W4,
    # this tree against .base alternating (18)
    TAIL=4 step attn_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_attention.py tests/kernels/test_kernels_gpu.py tests/models/test_families_gpu.py
    TAIL=80 step attn_wide_ragged 150 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --splits --ragged --no-mixed --decode 17x1500,24x1500,48x1350,96x1200
    grep -E "^decode|default" $OUT/attn_wide_ragged.log
    TAIL=2 step attn_wide_equal 120 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --splits --no-mixed --decode 24x1536,256x1024
    grep -E "^decode|default|SDPA enable" $OUT/attn_wide_equal.log
    TAIL=2 step attn_wide_llama 120 python3 benchmarks/bench_kernels.py --splits --ragged --no-mixed --decode 512x384,128x1024
    grep -E "^decode|default" $OUT/attn_wide_llama.log
    for r in 1 2; do
      TAIL=1 step w4_new_$r 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN
      (cd .base && TAIL=1 step w4_base_$r 150 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN)
    done ;;
  pairs3)  # carry .peer/p1 after stage: the new split rule on small ragged decodes, then the
    # W4 and W1b pairs (18)
    bash .peer/p1/install.sh | tail -1
    TAIL=2 step attn_splits_small 100 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --splits --ragged --no-mixed --decode 17x1500,24x1500,32x1400
    grep -E "^decode|default" $OUT/attn_splits_small.log
    j_w4_pair
    pair w1b 150 300 --workloads w1b --model $L3 ;;
  w4pairs)  # carry .peer/p1 after stage: three W4 pairs in one call, alternating engines
    # (vLLM's W4 figure moved 42.8-47.0k between hosts; asyncserve's 49.1-50.1k) (18)
    bash .peer/p1/install.sh | tail -1
    for r in 1 2 3; do pair w4_$r 100 200 --workloads w4 --model $QWEN; done ;;
  pdlab)  # carry .whl: programmatic dependent launch (kernels/pdl.py) on the GPU: the kernel
    # tests under PDL, then batch-1 W2 (W4A16, FP8) and W4 with ASYNCSERVE_PDL=0 against on,
    # alternating (14, 18)
    TAIL=4 step pdl_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_pdl.py tests/kernels/test_int4_gemv.py tests/kernels/test_fp8_gemv.py tests/kernels/test_norm.py tests/kernels/test_activation.py tests/kernels/test_rope_store.py tests/kernels/test_attention.py
    for r in 1 2; do
      for p in 0 1; do ASYNCSERVE_PDL=$p TAIL=1 step w4a16_pdl${p}_$r 120 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16; done
    done
    for p in 0 1; do ASYNCSERVE_PDL=$p TAIL=1 step fp8_pdl$p 120 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --quantization fp8; done
    for p in 0 1; do ASYNCSERVE_PDL=$p TAIL=1 step w4_pdl$p 120 python3 $SBS --engine asyncserve --workloads w4 --model $QWEN; done ;;
  attnorder)  # carry .whl: the attention grid with KV heads first (tests; ragged decode
    # batches of W4's spread, each grid order; it ran with W4 under a switch since removed:
    # the grid order is now attention.HEADS_FIRST, which --order flips) (18)
    TAIL=4 step attn_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_attention.py tests/kernels/test_kernels_gpu.py tests/kernels/test_pdl.py
    TAIL=30 step attn_order 200 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --no-mixed --decode "" --order 256x100-2000,128x100-2000,64x100-2000,256x900-1100 ;;
  lptprep)  # carry .whl .base (`git archive HEAD asyncserve benchmarks`, the commit before the
    # longest-first decode order): attention and graph tests on the GPU; ragged decode batches
    # of W4's spread, each grid order and sequence order (18)
    rm -rf /tmp/base && cp -r .base /tmp/base
    TAIL=4 step lpt_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_attention.py tests/kernels/test_pdl.py tests/worker/test_cuda_graphs_gpu.py
    TAIL=30 step attn_lpt 200 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --no-mixed --decode "" --order 256x100-2000,128x100-2000,64x100-2000,24x100-2000 ;;
  lptpair)  # carry .peer/p1 after lptprep and stage: W4, this tree, vLLM, then the tree in
    # /tmp/base (18)
    bash .peer/p1/install.sh | tail -1
    pair w4 100 200 --workloads w4 --model $QWEN
    PYTHONPATH=/tmp/site:/tmp/base TAIL=1 step w4_base 100 python3 /tmp/base/benchmarks/side_by_side.py --engine asyncserve --workloads w4 --model $QWEN ;;
  pairs4)  # carry .peer/p1 after stage: W4 twice and W1b once beside vLLM on the tree with
    # programmatic dependent launch and decodes longest first (18)
    bash .peer/p1/install.sh | tail -1
    for r in 1 2; do pair w4_$r 100 200 --workloads w4 --model $QWEN; done
    pair w1b 150 250 --workloads w1b --model $L3 ;;
  prefetch)  # carry .whl: how many weight lines the int4 GEMV prefetches into L2 before its PDL
    # wait (tests; each shape's neighbourhood at 0, 4, 16 and 64 lines a row), then W2 W4A16
    # (14)
    TAIL=4 step gemv_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_fp8_gemv.py tests/kernels/test_pdl.py
    TAIL=8 step int4_prefetch 300 python3 benchmarks/int4_gemv_bench.py --sweep --narrow --prefetch 0,4,16,64
    grep best $OUT/int4_prefetch.log
    TAIL=1 step w4a16 120 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16 ;;
  w2fuse)  # carry .whl .base .base2 .smol/a (.base: `git archive HEAD asyncserve benchmarks`
    # of 2c9195d; .base2: it with the int4 GEMV's prefetch off; this tree: a gated MLP's down
    # GEMV applying the activation, since reverted): its tests, then W2 W4A16 alternating
    # the three trees (14)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a
    rm -rf /tmp/base /tmp/base2 && cp -r .base /tmp/base && cp -r .base2 /tmp/base2
    TAIL=4 step fuse_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_activation.py tests/kernels/test_rope_store.py tests/kernels/test_argmax.py tests/quantization/test_int4_decode_fusions.py
    for t in base base2 new new base2 base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done ;;
  w2sym)  # carry .whl .base (`git archive 7f9b7d5 asyncserve benchmarks | tar -x -C .base`, before
    # symmetric int4 weights dropped their zeros): the int4 kernels' tests on the GPU; the GEMV
    # on Llama-3-8B's shapes with zeros and without; gate_up's K at 1056 to 2112 programs (one
    # and two full waves of 8 programs an SM on 132 SMs: does the 1.7-wave grid leave bandwidth
    # unused?); W2 W4A16 alternating .base and this tree (14)
    rm -rf /tmp/base && cp -r .base /tmp/base
    TAIL=4 step int4_tests 250 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_int4_gemm.py tests/quantization/test_int4_decode_fusions.py tests/quantization/test_int4_checkpoints.py
    TAIL=5 step gemv_zeros 150 python3 benchmarks/int4_gemv_bench.py --reps 100
    TAIL=5 step gemv_sym 150 python3 benchmarks/int4_gemv_bench.py --reps 100 --symmetric
    TAIL=5 step gemv_waves 150 python3 benchmarks/int4_gemv_bench.py --reps 100 --symmetric --shapes 16896x4096,22528x4096,28672x4096,33792x4096
    for t in base new new base new base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -h '"new_ms"' $OUT/gemv_*.log
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  w2check)  # carry .whl .smol/a: W2 W4A16 and FP8 on this tree (14)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a
    TAIL=1 step w2_w4a16 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
    TAIL=1 step w2_fp8 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --quantization fp8 ;;
  smoltests)  # carry .smol/b after w2fuse, w2check or w2trees: the engine's GPU tests on SmolLM2 (18: GPU fp32
    # equals CPU fp32; bf16 agreement)
    cat /tmp/smol/part_a .smol/b/part > $SMOL && sha256sum $SMOL | cut -c1-64 | diff - .smol/b/sha256 && echo "SmolLM2 assembled"
    ASYNCSERVE_TEST_GGUF=$SMOL TAIL=25 step gpu_tests_engine 400 python3 -m pytest -q -p no:cacheprovider -rfs -s tests/engine/test_gpu_engine.py tests/engine/test_gpu_agreement.py tests/engine/test_async_scheduling_gpu.py tests/worker ;;
  w4pair2)  # carry .peer/p1 after stage: two W4 pairs (18)
    bash .peer/p1/install.sh | tail -1
    for r in 1 2; do pair w4_$r 100 200 --workloads w4 --model $QWEN; done ;;
  w1bpair)  # after w4pair2 (vLLM installed): the W1b pair (18)
    pair w1b 150 250 --workloads w1b --model $L3 ;;
  pairs5)  # carry .peer/p1 after stage: a W4 pair and a W1b pair (18)
    bash .peer/p1/install.sh | tail -1
    pair w4 90 180 --workloads w4 --model $QWEN
    pair w1b 110 200 --workloads w1b --model $L3 ;;
  burst1)  # carry .whl: prefetch's tests and sweep, snake's orders, then W2 W4A16 with its
    # kernels summed (14, 18)
    TAIL=4 step gemv_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_pdl.py
    TAIL=8 step int4_prefetch 200 python3 benchmarks/int4_gemv_bench.py --sweep --narrow --prefetch 0,4,16,64
    grep best $OUT/int4_prefetch.log
    TAIL=50 step attn_snake 120 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --no-mixed --decode "" --order 32x100-2000,64x100-2000,96x100-2000,128x100-2000,256x100-2000
    TAIL=2 step w4a16_as_kernels 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16 --kernel-summary $OUT/w4a16_as_kernels.tsv ;;
  snake)  # carry .whl: decode attention's program orders on ragged batches of one to several
    # waves: listed, longest first, serpentine, and as the runner launches them (18)
    TAIL=50 step attn_snake 240 python3 benchmarks/bench_kernels.py --shape qwen3-0.6b --no-mixed --decode "" --order 32x100-2000,48x100-2000,64x100-2000,96x100-2000,128x100-2000,256x100-2000 ;;
  int4gemm)  # carry .whl: the whole-group int4 GEMM on the GPU (tests; against the per-column
    # GEMM and bf16 with a tile sweep), then W2 W4A16 alone with its kernels summed (14)
    TAIL=4 step int4_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemm.py tests/kernels/test_int4_gemv.py tests/quantization -k "int4 or gptq or awq or w4a16 or gemm"
    TAIL=30 step int4_gemm 300 python3 benchmarks/int4_gemm_bench.py --sweep
    grep best $OUT/int4_gemm.log
    TAIL=2 step w4a16_as_kernels 200 python3 $SBS --engine asyncserve --workloads w2 --model benchmarks/configs/llama3-8b-w4a16 --kernel-summary $OUT/w4a16_as_kernels.tsv ;;
  w2trees)  # carry .whl .base .base2 .smol/a (`git archive C asyncserve benchmarks | tar -x -C .base`:
    # .base 7872ac0, before the decode fusions; .base2 438ce0e, the gated gate_up GEMV and
    # o_proj's and down_proj's split sums in the add-norms): the fusions' tests, then W2
    # W4A16 alternating base, base2 and this tree (qkv_proj's split sums in rope-store, the
    # two-pass greedy argmax) (14)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a  # for smoltests next
    rm -rf /tmp/base /tmp/base2 && cp -r .base /tmp/base && cp -r .base2 /tmp/base2
    TAIL=4 step fusion_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_norm.py tests/kernels/test_activation.py tests/quantization/test_int4_decode_fusions.py
    for t in base base2 new new base2 base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done ;;
  w2prof)  # carry .whl .smol/a: the decode fusions' CUDA tests, then W2 W4A16 on this tree with
    # its kernels summed and the device's idle gaps (14)
    mkdir -p /tmp/smol && cp .smol/a/part /tmp/smol/part_a  # for smoltests next
    TAIL=4 step fusion_tests 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/quantization/test_int4_decode_fusions.py tests/kernels/test_argmax.py
    TAIL=1 step w2_w4a16 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
    TAIL=2 step w4a16_as_kernels 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16 --kernel-summary $OUT/w4a16_as_kernels.tsv
    cat $OUT/w4a16_as_kernels.tsv ;;
  w2trace)  # carry .whl: W2 W4A16 with its kernels traced (torch profiler, graph replays
    # included): each kernel's share of a decode step, start to next start
    # (benchmarks/step_trace.py) (14)
    TAIL=2 step w2_kernels 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16 --kernel-summary $OUT/w2_kernels.tsv
    python3 benchmarks/step_trace.py $OUT/w2_kernels.tsv.trace.csv > $OUT/w2_step_trace.txt 2>&1
    gzip $OUT/w2_kernels.tsv.trace.csv
    cat $OUT/w2_step_trace.txt ;;
  w2splits)  # carry .whl: W2 W4A16 with decode attention's split-KV factor as chosen (8 at
    # batch 1 in graphs captured for the model length) and forced to 1 and 2 (W2's contexts
    # stay under 400 keys), alternating; then a host + device trace of 32 decode steps (14)
    printf '%s\n' 'import runpy, sys' 'import asyncserve.kernels.attention as a' \
      'n = int(sys.argv.pop(1)); a.choose_num_splits = lambda *args: n' \
      'sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' > /tmp/force_splits.py
    for r in 1 2; do
      TAIL=1 step w2_chosen_$r 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      for n in 1 2; do TAIL=1 step w2_split${n}_$r 100 python3 /tmp/force_splits.py $n $SBS --engine asyncserve --workloads w2 --model $L3-w4a16; done
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log
    TAIL=3 step w2_host 150 python3 benchmarks/profile_step.py --model $L3-w4a16 --batch-size 1 --input-len 128 --output-len 32 --rows 30 --trace /tmp/w2_host.json
    gzip -c /tmp/w2_host.json > $OUT/w2_host.json.gz; ls -la $OUT/w2_host.json.gz ;;
  w2final)  # carry .whl: W2 W4A16 on this tree alternating with decode attention in 32-key
    # tiles (the split factor then 16 at batch 1), and W2 FP8 (14)
    printf '%s\n' 'import dataclasses, runpy, sys' 'import asyncserve.kernels.attention as a' \
      'base = a.default_config' \
      'a.default_config = lambda g, q, *r: dataclasses.replace(base(g, q, *r), tile_n=32) if q <= 8 else base(g, q, *r)' \
      'sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' > /tmp/tile32.py
    for r in 1 2; do
      TAIL=1 step w2_w4a16_$r 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      TAIL=1 step w2_tile32_$r 100 python3 /tmp/tile32.py $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
    done
    TAIL=1 step w2_fp8 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3 --quantization fp8
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  tried)  # carry .whl .base (`git archive 7f9b7d5 asyncserve benchmarks tests pyproject.toml | tar
    # -x -C .base`): W2 W4A16 under each patch of benchmarks/tried/, beside the tree it applies
    # to: norm_fusion (o_proj's GEMV adds the residual and gate_up's applies the post-attention
    # norm), nibble_unpack (the int4 GEMV without int-to-float conversions) and step_ahead (the
    # int4 GEMV loading its next step's words before each step's arithmetic) apply to .base
    # (7f9b7d5); early_words (the GEMV's first step's words loaded before its PDL wait) to this
    # tree; after the norm fusion's tests (14)
    rm -rf /tmp/base && cp -r .base /tmp/base
    for name in norm_fusion nibble_unpack step_ahead early_words; do
      src=/tmp/base; [ $name = early_words ] && src=.
      rm -rf /tmp/$name && mkdir /tmp/$name && (cd $src && cp -r asyncserve benchmarks tests pyproject.toml /tmp/$name/)
      patch -s -d /tmp/$name -p1 < benchmarks/tried/$name.patch
    done
    (cd /tmp/norm_fusion && PYTHONPATH=/tmp/site:/tmp/norm_fusion TAIL=2 step norm_fusion_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemv_norm_fusion.py tests/quantization/test_int4_decode_fusions.py)
    for t in base norm_fusion nibble_unpack step_ahead base new early_words new; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  gemvwide)  # carry .whl: the int4 GEMV's narrow sweep with whole-K steps (4096 columns: all of a
    # program's weight loads issued at once) and 8 warps beside the defaults (14)
    TAIL=8 step gemv_wide 300 python3 benchmarks/int4_gemv_bench.py --sweep --narrow --block-k 1024,2048,4096 --warps 4,8 --reps 50
    grep best $OUT/gemv_wide.log ;;
  w2tiles)  # carry .whl: W2 W4A16 on this tree alternating with the sweeps' best standalone tiles
    # (o_proj 8 x 2048 unsplit, gate_up 16 x 2048) (14)
    printf '%s\n' 'import runpy, sys' 'import asyncserve.kernels.int4_gemv as g' 'base = g.gemv_config' \
      'best = {(4096, 4096): g.GemvConfig(8, 2048, 1), (28672, 4096): g.GemvConfig(16, 2048, 1)}' \
      'g.gemv_config = lambda n, k, *a: best.get((n, k)) or base(n, k, *a)' \
      'sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' > /tmp/tiles.py
    for t in new tiles tiles new; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/tiles.py $SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  w2ablate)  # carry .whl: W2 W4A16 with decode kernels left out (benchmarks/w2_ablate.py: the most
    # fusing each away could gain), alternating with the full step (14)
    for r in 1 2; do
      TAIL=1 step w2_full_$r 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      for kinds in rope merge norm rope,merge; do
        TAIL=1 step w2_no_${kinds/,/_}_$r 100 python3 benchmarks/w2_ablate.py $kinds $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      done
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  gemvtiles)  # carry .whl: the int4 GEMV's tiles around each shape's default, with half-height
    # (8-row) tiles and 2048-column steps added (more bytes a load step) (14)
    TAIL=2 step gemv_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemv.py
    TAIL=8 step int4_tiles 400 python3 benchmarks/int4_gemv_bench.py --sweep --narrow
    grep best $OUT/int4_tiles.log ;;
  dotsplit)  # carry .whl: the whole-group int4 GEMM with K splits at 1, 4, 16, 128 tokens (tests;
    # a sweep of narrow tiles, pipeline depths and splits beside the GEMV at 1 and 4) (14)
    TAIL=4 step int4_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_int4_gemm.py
    TAIL=12 step int4_split 400 python3 benchmarks/int4_gemm_bench.py --m 1 4 16 128 --sweep --split --no-per-column --reps 30
    grep -h '"m"' $OUT/int4_split.log | grep -v sweep
    grep best $OUT/int4_split.log ;;
  tma)  # carry .whl: the int4 GEMV loading its words through a TMA descriptor, pipelined
    # (benchmarks/int4_gemv_tma.py: a check, then tiles x stages x splits beside int4_gemv) (14)
    TAIL=2 step tma_check 120 python3 benchmarks/int4_gemv_tma.py --check
    TAIL=12 step tma_sweep 400 python3 benchmarks/int4_gemv_tma.py
    grep -h -e int4_gemv_ms -e best $OUT/tma_sweep.log ;;
  w2attn)  # carry .whl: W2 W4A16 with decode attention left out, and with the rotary + KV
    # store too, alternating with the full step: what attention costs a token in place (14)
    for r in 1 2; do
      TAIL=1 step w2_full_$r 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      for kinds in attn rope,attn; do
        TAIL=1 step w2_no_${kinds/,/_}_$r 100 python3 benchmarks/w2_ablate.py $kinds $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      done
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  w2pre)  # carry .whl .base (`git archive HEAD asyncserve benchmarks | tar -x -C .base`, the tree
    # before): decode attention and the rotary + KV store reading the batch's layout (and
    # attention prefetching its first key tile into L2) before their PDL waits: their tests on
    # the GPU, then W2 W4A16 alternating .base and this tree (14)
    rm -rf /tmp/base && cp -r .base /tmp/base
    TAIL=3 step pre_tests 250 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_attention.py tests/kernels/test_rope_store.py tests/kernels/test_pdl.py tests/quantization/test_int4_decode_fusions.py
    for t in base new new base new base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log ;;
  pretests)  # carry .whl: decode attention's and the rotary + KV store's tests on the GPU, with
    # the int4 decode fusions' (rotary + store from split sums, exact) (14)
    TAIL=3 step pre_tests 250 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_attention.py tests/kernels/test_rope_store.py tests/kernels/test_pdl.py tests/quantization/test_int4_decode_fusions.py ;;
  ropecheck)  # carry .whl .base (`git archive 7e3818c~1 asyncserve benchmarks`): the rotary + KV
    # store's split-sums test in fp32 on .base's kernels, this tree's, and this tree's without PDL
    rm -rf /tmp/base && cp -r .base /tmp/base
    T="tests/kernels/test_rope_store.py -k split_sums"
    (export PYTHONPATH=/tmp/site:/tmp/base:$PWD; cd /tmp/base && cp -r $OLDPWD/tests $OLDPWD/pyproject.toml . && TAIL=2 step rope_base 150 python3 -m pytest -q -p no:cacheprovider $T)
    TAIL=2 step rope_new 150 python3 -m pytest -q -p no:cacheprovider $T
    ASYNCSERVE_PDL=0 TAIL=2 step rope_nopdl 150 python3 -m pytest -q -p no:cacheprovider $T ;;
  w2normw)  # carry .whl .base (`git archive HEAD asyncserve benchmarks`, the tree before): the
    # RMSNorm kernels loading their weight before the PDL wait; norm tests on the GPU, W2 W4A16
    # alternating .base and this tree, then this tree's decode step traced (14)
    rm -rf /tmp/base && cp -r .base /tmp/base
    TAIL=2 step norm_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels -k norm
    for t in base new new base new base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log
    TAIL=2 step w2_kernels 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16 --kernel-summary $OUT/w2_kernels.tsv
    python3 benchmarks/step_trace.py $OUT/w2_kernels.tsv.trace.csv > $OUT/w2_step_trace.txt 2>&1
    gzip $OUT/w2_kernels.tsv.trace.csv
    cat $OUT/w2_step_trace.txt ;;
  w2prefill)  # carry .whl .base (`git archive HEAD asyncserve benchmarks`, the tree before): lone
    # prompts' graphs at 64 and 128 rows as well (W2's 128-token prompt ran padded to 256 rows);
    # their test on the GPU, W2 W4A16 alternating .base and this tree, lone 64- and 128-token
    # prompts (bf16) on each; then the int4 prompt GEMM with its operands swapped (14)
    rm -rf /tmp/base && cp -r .base /tmp/base
    TAIL=2 step prefill_tests 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/worker/test_prefill_graphs.py
    for t in base new new base; do
      if [ $t = new ]; then TAIL=1 step w2_${t}_$SECONDS 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
      else PYTHONPATH=/tmp/site:/tmp/$t TAIL=1 step w2_${t}_$SECONDS 100 python3 /tmp/$t/$SBS --engine asyncserve --workloads w2 --model $L3-w4a16; fi
    done
    grep -o '"ms_per_token": [0-9.]*' $OUT/w2_*.log
    for len in 64 128; do
      TAIL=1 step lone_${len}_new 120 python3 benchmarks/lone_prefill.py --input-len $len
      PYTHONPATH=/tmp/site:/tmp/base TAIL=1 step lone_${len}_base 120 python3 /tmp/base/benchmarks/lone_prefill.py --input-len $len
    done
    TAIL=2 step gemm_variants 200 python3 benchmarks/int4_gemm_bench.py --variants --which 0 3 --m 128 --reps 30
    variants_best ;;
  w2host)  # carry .whl: W2 W4A16's host steps under async scheduling, the slowest periods with
    # their calls (the device idled ~1-1.5 ms every ~63 steps in the last trace); the int4
    # prompt GEMM with its operands swapped (VARIANT 3) beside this one at 128 and 512 tokens (14)
    TAIL=40 step w2_host 200 python3 benchmarks/step_phases.py --model $L3-w4a16 --load-format dummy \
      --input-len 128 --output-len 256 --no-detokenize --async-scheduling --slowest 10
    TAIL=2 step gemm_variants 300 python3 benchmarks/int4_gemm_bench.py --variants --which 0 3 --m 128 512 --reps 30
    variants_best ;;
  w2pairs)  # carry .peer/p1 after pretests and stage: the W2 pairs, W4A16 and FP8 (14)
    bash .peer/p1/install.sh | tail -1
    j_w4a16_pair
    pair fp8 150 250 --workloads w2 --model $L3 --quantization fp8
    TAIL=1 step w2_w4a16_again 100 python3 $SBS --engine asyncserve --workloads w2 --model $L3-w4a16
    grep -h -o '"ms_per_token": [0-9.]*' $OUT/w4a16_*.log $OUT/fp8_*.log $OUT/w2_*.log ;;
  w1bfp8)  # carry .peer/p1 after stage: W1b with FP8 weights beside vLLM's, and asyncserve's
    # bf16 W1b in the same call (the issue: FP8 >= 1.3x bf16 and >= vLLM FP8), then vLLM's bf16 (14)
    bash .peer/p1/install.sh | tail -1
    pair w1b_fp8 150 250 --workloads w1b --model $L3 --quantization fp8
    TAIL=2 step w1b_bf16_as 150 python3 $SBS --engine asyncserve --workloads w1b --model $L3
    TAIL=2 step w1b_bf16_vllm 200 env $VENV python3 $SBS --engine vllm --workloads w1b --model $L3
    grep -h -o '"engine": "[a-z]*", "workload": "w1b".*"total_tok_s": [0-9.]*' $OUT/w1b_*.log ;;
  w3kv)  # carry .whl: W3 at 16 req/s with bf16 and fp8 KV caches, one server after the other,
    # and each pool's size (the issue: TPOT within 5% while the pool holds twice the tokens) (14)
    for kv in auto fp8; do w3_kv $kv $kv; grep -i "KV blocks" $OUT/w3_server_$kv.log; done ;;
  fp8kv)  # carry .whl: a mixed step's attention and K/V store over bf16 and fp8 caches
    # (benchmarks/attention_fp8_kv.py); then W3 at 16 req/s again, fp8 KV first this time (14)
    TAIL=20 step attn_fp8_kv 200 python3 benchmarks/attention_fp8_kv.py
    for kv in fp8 auto; do w3_kv $kv $kv; done ;;
  w3kvalt)  # carry .whl: W3 at 16 req/s, bf16 and fp8 KV alternating over four servers (the
    # second server of a call ran 8-13% slower in fp8kv and w3kv, whichever its dtype) (14)
    for run in auto1 fp81 auto2 fp82; do w3_kv $run ${run%[12]}; done ;;
  w4a16)  # carry .peer/p1 after stage: the W4A16 batch-1 pair (14)
    bash .peer/p1/install.sh | tail -1
    j_w4a16_pair ;;
  check)  # carry .whl
    deal j_kernel_checks j_w4_cold_warm ;;
  pairs)  # carry .peer/p1
    bash .peer/p1/install.sh | tail -1
    deal j_w4_pair "j_llava j_llava_kernels" ;;
  disagg)  # carry .whl; a 2-GPU host: compile-once checks, then disaggregated prefill vs DP=2
    TAIL=4 step compile_checks 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/kernels/test_kernels_gpu.py tests/worker/test_kv_blocks.py -k "compile or cuda_write"
    TAIL=30 step disagg_serving 400 python3 benchmarks/disagg_serving.py --input-len 4096 --output-len 256 --num-prompts 200 --request-rate 5 --out $OUT
    grep -h "compiled after start-up" $OUT/*.log | cut -c1-80 | sort | uniq -c ;;
  w1b_diag)  # carry .whl: where W1b's time goes at 512 and at 1024 sequences (18)
    deal j_w1b_diag_512 j_w1b_diag_1024 ;;
  syncs)  # carry .whl: host waits inside W1b's decode steps (torch's sync debug mode)
    TAIL=40 step syncs_512 150 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 512 --input-len 256 --output-len 64 --no-detokenize --sync-debug
    TAIL=40 step syncs_1000 150 python3 benchmarks/step_phases.py --model $L3 --load-format dummy --batch-size 1000 --input-len 256 --output-len 64 --max-num-seqs 1024 --no-detokenize --sync-debug ;;
  *) echo "unknown part $1"; exit 2 ;;
esac
finish $1
