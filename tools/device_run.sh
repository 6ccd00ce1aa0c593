#!/usr/bin/env bash
# Runs on the GPU machine (see docs/benchmarks.md). Usage: tools/device_run.sh check|bench-small|bench-full
# Expects the carried folder .devcarry/ (msgspec + gguf wheels, a saved copy of the SmolLM2 tokenizer).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 TOKENMILL_TEST_TOKENIZER_DIR="$PWD/.devcarry/tokenizer"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
mode=${1:-check}
bench() { echo "=== $*"; python3 -m tokenmill.benchmarks."$@" 2>&1 | grep -vE "Processed prompts|^INFO .*(Loaded|Captured)"; }
lat1() {  # lat1 MODEL LIMIT_S [TAG]: the batch-1 latency bench of the targets (128 in, 256 out), JSON to
          # $OUT/lat_MODEL[_TAG].json
  echo "--- lat1 $1 ${3:-} (TOKENMILL_PDL_EARLY=${TOKENMILL_PDL_EARLY:-})"
  timeout "$2" python3 -m tokenmill.benchmarks.latency --model "$1" --batch-size 1 --input-len 128 --output-len 256 \
    --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$1${3:+_$3}.json" 2>&1 \
    | grep -E "decode|Error"
}
best_early() {  # best_early MODEL: the TOKENMILL_PDL_EARLY value of the fastest env-only early-* variant in ab's output
  local name
  name=$(awk '$1 ~ /^early-(small|gemv|all)$/ {print $2, $1}' "$OUT/ab_$1.txt" | sort -n | head -1 | cut -d' ' -f2)
  case "$name" in
    early-small) echo "attention,norm,rope,act" ;; early-gemv) echo gemv ;; early-all) echo all ;; *) echo "" ;;
  esac
}
ab() {  # ab MODEL LIMIT_S [TAG [ARGS...]]: tools/graph_ab.py's batch-1 graph A/B, also to $OUT/ab_MODEL[_TAG].txt
  local m=$1 lim=$2 tag=${3:-}
  shift $(( $# < 3 ? $# : 3 ))
  timeout "$lim" python3 tools/graph_ab.py "$m" "$@" 2>&1 | grep -vE "^INFO|Loading|it/s" \
    | tee "$OUT/ab_$m${tag:+_$tag}.txt"
}
nano() {  # nano MODEL LIMIT_S NAME [ARGS...]: the nano-vllm workload (the #4 throughput command), JSON to $OUT/NAME.json
  local m=$1 lim=$2 name=$3
  shift 3
  timeout "$lim" python3 -m tokenmill.benchmarks.throughput --model "$m" --num-prompts 256 --input-len 562 \
    --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 "$@" \
    --output-json "$OUT/$name.json" 2>&1 | grep -E "Throughput|Error|max_num_batched_tokens defaults"
}
cold_start() {  # Llama-3-8B dummy: process start to first token, CUDA graphs captured
  echo "=== cold start llama-3-8b (process start to first token, graphs captured)"
  local t0 t1
  t0=$(date +%s.%N)
  timeout 90 python3 -c "
from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir
llm = LLM(shipped_model_dir('llama-3-8b'), load_format='dummy', skip_tokenizer_init=True, max_model_len=2048)
llm.generate({'prompt_token_ids': [1, 2, 3]}, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
" 2>&1 | grep -E "Captured|KV cache"; t1=$(date +%s.%N); echo "cold start: $(python3 -c "print(round($t1 - $t0, 1))") s"
}
tp2_test() {  # tp2_test DUMP_AFTER_S LIMIT_S: the TP=2 GPU equality test; py-spy dumps to tp2.txt if it stalls
  echo "=== tp2 equality"
  (sleep "$1"; for p in $(pgrep -f "pytest|worker_proc"); do echo "--- $p"; /tmp/site/bin/py-spy dump --pid $p 2>&1 \
     | head -30; done > "$OUT/tp2.txt") &
  timeout "$2" python3 -m pytest -q -p no:cacheprovider --tb=short \
    "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" > "$OUT/tp2_pytest.txt" 2>&1
  echo "pytest exit $?"; tail -5 "$OUT/tp2_pytest.txt"
}
case "$mode" in
  check+bench-small)
    "$0" check; "$0" bench-small
    ;;
  check)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/layers tests/gpu 2>&1 | tail -25
    ;;
  probe)
    "$0" check
    echo "=== profile qwen3-0.6b"; python3 tools/profile_steps.py qwen3-0.6b 2>&1 | grep -vE "^INFO"
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json"
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --no-async-scheduling
    export TOKENMILL_STEP_TIMING=1
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_qwen3.json"
    unset TOKENMILL_STEP_TIMING
    ;;
  probe2)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/layers 2>&1 | tail -15
    echo "=== bench_gemv"; python3 tools/bench_gemv.py 2>&1
    echo "=== diag_bf16"; python3 tools/diag_bf16.py 2>&1 | grep -vE "^INFO|Loading weights|it/s"
    echo "=== profile qwen3-0.6b"; python3 tools/profile_steps.py qwen3-0.6b 2>&1 | grep -vE "^INFO"
    export TOKENMILL_STEP_TIMING=1
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_qwen3.json"
    unset TOKENMILL_STEP_TIMING
    ;;
  probe3)
    python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/layers tests/gpu tests/worker 2>&1 | tail -12
    echo "=== profile qwen3-0.6b"; python3 tools/profile_steps.py qwen3-0.6b 2>&1 | grep -vE "^INFO"
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json"
    TOKENMILL_GEMV=never bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 \
      --num-iters 3 --num-iters-warmup 1 --max-model-len 2048
    bench latency --model llama-3-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_llama8b.json"
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_qwen3.json"
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --kv-cache-dtype fp8 \
      --output-json "$OUT/tp_qwen3_fp8.json"
    ;;
  final2)
    echo "=== structured outputs serve bench"; timeout 330 bash tools/device_so_bench.sh 2>&1 | tail -45
    echo "=== gpu tests"; timeout 170 python3 -m pytest -q -p no:cacheprovider --tb=line -rf tests/gpu tests/worker \
      --deselect "tests/gpu/test_gpu_e2e.py::test_greedy_matches_hf_on_cuda[float32-auto-llama]" 2>&1 | tail -14
    cold_start
    timeout 100 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_llama8b.json" 2>&1 | grep -E "Throughput|Total"
    ;;
  final3)  # on nvidia-h200-x2 (the TP=2 parts need two GPUs); most important first, the device budget is short
    echo "=== structured outputs serve bench"; SO_NOISE_RUN=0 timeout 200 bash tools/device_so_bench.sh 2>&1 | tail -14
    echo "=== gpu tests"; timeout 130 python3 -m pytest -q -p no:cacheprovider --tb=line -rf tests/gpu \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tail -14
    for tp in 1 2; do
      timeout 75 python3 -m tokenmill.benchmarks.latency --model llama-3-8b -tp $tp --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
        --output-json "$OUT/lat_llama8b_tp$tp.json" 2>&1 | grep -E "^Avg|decode:|Error|error" ; done
    timeout 120 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b -tp 2 --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_llama8b_tp2.json" 2>&1 | grep -E "Throughput|Error|error"
    ;;
  next)  # on nvidia-h200-x2: what session 2 could not verify, most important first
    echo "=== gpu tests"; timeout 190 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/gpu tests/layers \
      tests/kernels/test_triton_bitmask.py tests/kernels/test_triton_sampling.py \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tee "$OUT/tests.log" | tail -30
    echo "=== structured outputs serve bench"; SO_NOISE_RUN=0 timeout 170 bash tools/device_so_bench.sh 2>&1 | tail -12
    echo "=== fp8 decode tiles"; timeout 100 python3 tools/tune_attention.py fp8 2>&1 | tail -25
    timeout 110 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b -tp 2 --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_llama8b_tp2.json" 2>&1 | grep -E "Throughput|Error|error"
    ;;
  call2)  # on nvidia-h200-x2: where structured requests' cost goes, then the GPU tests
    echo "=== structured offline profile (full log in notes.txt)"
    TOKENMILL_STEP_TIMING=1 timeout 100 python3 tools/profile_structured.py .devcarry/smollm2-dummy 2>&1 \
      | grep -vE "^INFO" > "$OUT/notes.txt"; grep -E "^===" "$OUT/notes.txt"
    echo "=== SO bench with py-spy"; SO_NOISE_RUN=0 SO_PYSPY=1 timeout 170 bash tools/device_so_bench.sh 2>&1 | tail -9
    echo "=== gpu tests"; timeout 200 python3 -m pytest -v -p no:cacheprovider --tb=short -rf --durations=12 tests/gpu \
      tests/layers tests/kernels/test_triton_bitmask.py tests/kernels/test_triton_sampling.py > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -15; cat "$OUT/tests.log" >> "$OUT/notes.txt"; rm "$OUT/tests.log"
    echo "=== tp2 equality"; timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tail -12
    ;;
  call3)  # on nvidia-h200-x2: the constrained/replay cProfile difference, then why the TP=2 GPU test stalls
    echo "=== structured offline profile"
    TOKENMILL_STEP_TIMING=1 timeout 150 python3 tools/profile_structured.py .devcarry/smollm2-dummy 2>&1 \
      | grep -vE "^INFO" > "$OUT/notes.txt"; grep -E "^===.*steps" "$OUT/notes.txt"
    echo "=== tp2 equality (py-spy dumps after 100 s go to tp2.txt)"
    (sleep 100; for p in $(pgrep -f python3); do echo "--- $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-150)"
       /tmp/site/bin/py-spy dump --pid $p 2>&1 | head -60; done > "$OUT/tp2.txt") &
    timeout 130 python3 -m pytest -q -s -p no:cacheprovider --tb=short \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" > "$OUT/tp2_log.txt" 2>&1
    echo "rc $?"; tail -5 "$OUT/tp2_log.txt"; wait
    ;;
  call4)  # on nvidia-h200-x2: the structured-outputs bench after the numpy bitmask fix; TP=2 test and throughput
    echo "=== structured outputs serve bench"; SO_NOISE_RUN=0 timeout 170 bash tools/device_so_bench.sh 2>&1 | tail -7
    echo "=== tp2 equality"; timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tail -3
    echo "=== llama-3-8b throughput, TP=2"
    timeout 120 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b -tp 2 --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_llama8b_tp2.json" 2>&1 | grep -E "Throughput|Error|error|Captured"
    ;;
  next3)  # on nvidia-h200-x2, session 4: re-measure issue 5 after the GC freeze; the TP=2 test after the teardown fix
    echo "=== structured outputs serve bench"; SO_NOISE_RUN=0 timeout 200 bash tools/device_so_bench.sh 2>&1 | tail -7
    echo "=== tp2 equality (py-spy dumps after 200 s go to tp2.txt)"
    (sleep 200; for p in $(pgrep -f python3); do echo "--- $p"; /tmp/site/bin/py-spy dump --pid $p 2>&1 | head -40
       done > "$OUT/tp2.txt") &
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tail -4
    ;;
  s4a)  # on nvidia-h200-x2, session 4: issue 5's bench with stall diagnostics; the TP=2 test after the abort fix
    echo "=== structured outputs serve bench (diagnostics on)"
    SO_DIAG=1 SO_NOISE_RUN=0 timeout 260 bash tools/device_so_bench.sh 2>&1 | tail -110
    tp2_test 170 200
    ;;
  s4b)  # on nvidia-h200-x2: issue 5's bench with diagnostics and py-spy summaries; the TP=2 test (NCCL world forgotten)
    SO_DIAG=1 SO_PYSPY=1 SO_NOISE_RUN=0 timeout 270 bash tools/device_so_bench.sh > "$OUT/so_bench.txt" 2>&1
    for r in mixed replay; do
      [ -f "$OUT/spy_$r.txt" ] && python3 tools/spy_summary.py "$OUT/spy_$r.txt" --under execute_model --top 30 \
        >> "$OUT/so_bench.txt" 2>&1
      rm -f "$OUT/spy_$r.txt"
    done
    grep -E "^===|acceptance|slowdown|Triton|_kernel|^[0-9]+$" "$OUT/so_bench.txt" | head -30
    tp2_test 150 180
    ;;
  s4c)  # on nvidia-h200-x2: GPU tests (mixed-batch graphs), then issue 5's bench with diagnostics
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -x tests/gpu/test_gpu_e2e.py \
      tests/kernels/test_triton_attention.py > "$OUT/gpu_pytest.txt" 2>&1
    echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    SO_DIAG=1 SO_NOISE_RUN=0 timeout 250 bash tools/device_so_bench.sh > "$OUT/so_bench.txt" 2>&1
    grep -E "^=== (fair|summary)|acceptance|slowdown|_kernel|Captured|^[0-9]+$" "$OUT/so_bench.txt" | head -20
    ;;
  s5a)  # on nvidia-h200-x2: GPU tests (folded graph path, symmetric all-reduce), TP=2 equality, all-reduce
        # latency, Llama-3-8B bs1 TP=1 / TP=2 / TP=2 with NCCL only
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -x tests/gpu/test_gpu_e2e.py \
      tests/kernels/test_triton_attention.py tests/distributed/test_symm_all_reduce.py > "$OUT/gpu_pytest.txt" 2>&1
    echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    tp2_test 60 80
    echo "=== all-reduce latency"; timeout 50 python3 tools/bench_all_reduce.py 2>&1 | grep -vE "^(INFO|W[0-9])" | tail -12
    for v in "1" "2" "2 --disable-custom-all-reduce"; do
      echo "=== llama-3-8b bs1 -tp $v"
      timeout 85 python3 -m tokenmill.benchmarks.latency --model llama-3-8b -tp $v --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
        --output-json "$OUT/lat_llama8b_tp${v// /_}.json" 2>&1 | grep -E "^Avg|decode|Error|error|symmetric" | head -8
    done
    ;;
  s5b)  # PDL probe, gemv sweep for Llama-3-8B's fused and TP=2 shapes, where the throughput workload's GPU time goes
    echo "=== probe_pdl"; timeout 60 python3 tools/probe_pdl.py 2>&1 | tail -8
    echo "=== bench_gemv"; timeout 240 python3 tools/bench_gemv.py --shapes llama8b,llama8b-tp2 --ms 1 --no-rope \
      --budget 110 > "$OUT/bench_gemv.txt" 2>&1; echo "exit $?"; grep -vE "^#   " "$OUT/bench_gemv.txt" | tail -40
    echo "=== profile_throughput"; timeout 150 python3 tools/profile_throughput.py qwen3-0.6b 2>&1 \
      | grep -vE "^(INFO|WARNING)" | tail -24
    ;;
  s5c)  # on nvidia-h200-x2: Qwen3 throughput profile (+ split and fp8 variants), Llama-3-8B TP=1 vs TP=2
    export TRITON_CACHE_DIR=/tmp/tc5; rm -rf $TRITON_CACHE_DIR
    flt() { grep -vE "^(INFO|WARNING)|UserWarning|_warn_once"; }
    echo "=== qwen3 throughput profile"; timeout 120 python3 tools/profile_throughput.py qwen3-0.6b 2>&1 | flt | tail -42
    echo "=== min-splits 4"; timeout 70 python3 tools/profile_throughput.py qwen3-0.6b --no-profile --min-splits 4 \
      2>&1 | grep -E "output tok/s|decode +(128|256):"
    echo "=== fp8 kv"; timeout 80 python3 tools/profile_throughput.py qwen3-0.6b --no-profile kv_cache_dtype=fp8 \
      2>&1 | grep -E "output tok/s|decode +(128|256):|Error"
    for tp in 1 2; do
      echo "=== llama-3-8b tp=$tp"; timeout 150 python3 tools/tp_compare.py run $tp "$OUT/tp$tp.json" 2>&1 \
        | grep -E "^TP=|Error|error" | head -5
    done
    python3 tools/tp_compare.py compare "$OUT/tp1.json" "$OUT/tp2.json"
    ;;
  s5d)  # host-side profiles: Qwen3 throughput and batch-1 (cProfile, sync debug), then clean timings
    export TRITON_CACHE_DIR=/tmp/tc5; rm -rf $TRITON_CACHE_DIR
    flt() { grep -vE "^(INFO|WARNING)|UserWarning|_warn_once|^\s*$"; }
    echo "=== qwen3 throughput, clean"; timeout 80 python3 tools/profile_throughput.py qwen3-0.6b --no-profile 2>&1 \
      | flt | grep -vE "^  (grammar|eager|graph)" | head -30
    echo "=== qwen3 throughput, cProfile + sync debug"; timeout 100 python3 tools/profile_throughput.py qwen3-0.6b \
      --no-profile --cprofile --sync-debug 2>&1 | flt | grep -vE "^  (decode|prefill) |Step timing|^  [a-z_]+ +[0-9.]+ ms" | head -60
    echo "=== qwen3 bs1, cProfile"; timeout 80 python3 tools/profile_throughput.py qwen3-0.6b --bs1 --no-profile \
      --cprofile 2>&1 | flt | head -50
    echo "=== qwen3 bs1, clean"; timeout 60 python3 tools/profile_throughput.py qwen3-0.6b --bs1 2>&1 | flt | head -30
    ;;
  s5e)  # decode-attention launch configs for the throughput workload's ragged batches, bf16 and fp8 caches
    echo "=== bf16"; timeout 200 python3 tools/tune_attention.py auto ragged 2>&1 | grep -vE "^(INFO|WARNING)"
    echo "=== fp8"; timeout 200 python3 tools/tune_attention.py fp8 ragged 2>&1 | grep -vE "^(INFO|WARNING)"
    ;;
  s5f)  # on nvidia-h200-x2: session 5's final numbers (issue 4 and 6 tables in docs/benchmarks.md)
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_attention.py \
      > "$OUT/attn_pytest.txt" 2>&1; echo "attention gpu pytest exit $?"; tail -2 "$OUT/attn_pytest.txt"
    timeout 90 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    timeout 60 python3 -m tokenmill.benchmarks.latency --model qwen3-0.6b --batch-size 1 --input-len 128 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json" \
      2>&1 | grep -E "decode|Error"
    timeout 80 python3 -m tokenmill.benchmarks.latency --model llama-3-8b --batch-size 1 --input-len 128 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_llama8b.json" \
      2>&1 | grep -E "decode|Error"
    for tp in 1 2; do
      timeout 130 python3 tools/tp_compare.py run $tp "$OUT/tp$tp.json" 2>&1 | grep -E "^TP=|Error|error" | head -5
    done
    python3 tools/tp_compare.py compare "$OUT/tp1.json" "$OUT/tp2.json"
    ;;
  s5g)  # A/B of the decode tiles on the throughput workload, alternating
    for v in "" --small-decode-tiles "" --small-decode-tiles; do
      timeout 60 python3 tools/profile_throughput.py qwen3-0.6b --no-profile $v 2>&1 | grep -E "output tok/s"
      echo "  ($v)"
    done
    ;;
  s6a)  # on nvidia-h200-x2: GPU tests of session 5's untested changes, TP=2 equality, PDL probe, bs1 kernel table
    flt() { grep -vE "^(INFO|WARNING)|UserWarning|_warn_once|^\s*$"; }
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/layers tests/gpu \
      tests/distributed/test_symm_all_reduce.py > "$OUT/gpu_pytest.txt" 2>&1
    echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -12
    tp2_test 70 90
    echo "=== probe_pdl"; timeout 60 python3 tools/probe_pdl.py 2>&1 | tail -8
    echo "=== qwen3 bs1 kernels"; timeout 90 python3 tools/profile_throughput.py qwen3-0.6b --bs1 2>&1 | flt | head -70
    ;;
  s6b)  # PDL: GPU kernel tests, batch-1 A/B (Qwen3, Llama-3-8B) with TOKENMILL_PDL=1/0, gemv sweep with PDL
    timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/gpu/test_gpu_e2e.py \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -12
    for run in qwen3-0.6b:1 qwen3-0.6b:0 qwen3-0.6b:1 llama-3-8b:1 llama-3-8b:0; do model=${run%:*} pdl=${run#*:}
      echo "=== $model bs1 TOKENMILL_PDL=$pdl"
      TOKENMILL_PDL=$pdl timeout 80 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 2>&1 | grep -E "decode|Error|error"
    done
    echo "=== bench_gemv bs1 shapes, PDL on"; timeout 200 python3 tools/bench_gemv.py --shapes bs1 --ms 1 --no-rope --deep \
      --budget 120 > "$OUT/bench_gemv.txt" 2>&1; echo "exit $?"; grep -vE "^#   " "$OUT/bench_gemv.txt" | tail -32
    ;;
  s6c)  # PDL + deep-K gemv table + merged decode attention: GPU tests, batch-1 split tuning, bs1 and throughput
    timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/gpu/test_gpu_e2e.py \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -12
    echo "=== tune_attention bs1"; timeout 120 python3 tools/tune_attention.py bs1 2>&1 | grep -vE "^(INFO|WARNING)"
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== $model bs1"
      timeout 80 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 2>&1 | grep -E "decode|Error|error"
    done
    echo "=== qwen3 throughput"; timeout 90 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 \
      --input-len 562 --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 2>&1 \
      | grep -E "Throughput|Error"
    ;;
  s6d)  # on nvidia-h200-x2: session 6's final numbers (PDL, deep-K batch-1 gemv table)
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_gemv.py > "$OUT/kernels_pytest.txt" 2>&1; echo "kernel gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/kernels_pytest.txt" | tail -6
    for tp in 1 2; do
      timeout 140 python3 tools/tp_compare.py run $tp "$OUT/tp$tp.json" 2>&1 | grep -E "^TP=|Error|error" | head -5
    done
    python3 tools/tp_compare.py compare "$OUT/tp1.json" "$OUT/tp2.json"
    timeout 90 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    for model in qwen3-0.6b llama-3-8b; do
      timeout 80 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$model.json" \
        2>&1 | grep -E "decode|Error"
    done
    echo "=== qwen3 bs1 kernels"; timeout 70 python3 tools/profile_throughput.py qwen3-0.6b --bs1 2>&1 \
      | grep -vE "^(INFO|WARNING)|UserWarning|_warn_once|^\s*$" | head -40
    ;;
  s6e)  # on nvidia-h200: session 6's final issue-4 numbers (PDL, deep-K batch-1 gemv table), A/B with PDL off
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_gemv.py > "$OUT/kernels_pytest.txt" 2>&1; echo "kernel gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/kernels_pytest.txt" | tail -6
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== $model throughput"
      timeout 120 python3 -m tokenmill.benchmarks.throughput --model $model --num-prompts 256 --input-len 562 \
        --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
        --output-json "$OUT/tp_$model.json" 2>&1 | grep -E "Throughput|Error"
      echo "=== $model bs1"
      timeout 80 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$model.json" \
        2>&1 | grep -E "decode|Error"
    done
    echo "=== qwen3-0.6b bs1, TOKENMILL_PDL=0"
    TOKENMILL_PDL=0 timeout 60 python3 -m tokenmill.benchmarks.latency --model qwen3-0.6b --batch-size 1 --input-len 128 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 2>&1 | grep -E "decode|Error"
    echo "=== tune_attention bs1"; timeout 60 python3 tools/tune_attention.py bs1 2>&1 | grep -vE "^(INFO|WARNING)"
    echo "=== qwen3 bs1 kernels"; timeout 70 python3 tools/profile_throughput.py qwen3-0.6b --bs1 2>&1 \
      | grep -vE "^(INFO|WARNING)|UserWarning|_warn_once|^\s*$" | head -40
    ;;
  s7a)  # on nvidia-h200-x2: PDL under TP=2 (s5h's tests), then where batch 1's time goes
    "$0" s5h
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== profile_steps $model --bs1-only"
      timeout 150 python3 tools/profile_steps.py $model --bs1-only > "$OUT/steps_$model.txt" 2>&1
      grep -vE "^(INFO|WARNING)" "$OUT/steps_$model.txt" | grep -E "ms per|back to back|synced|Error" | head -12
    done
    ;;
  s7e)  # host cost of pinned staging variants while the GPU is busy
    timeout 60 python3 tools/probe_staging.py 2>&1
    ;;
  s7g)  # on nvidia-h200-x2: Llama-3-8B batch-1 decode, TP=1 then TP=2 (PDL on), bench latency
    for tp in 1 2; do
      echo "=== llama-3-8b bs1 tp=$tp"
      timeout 130 python3 -m tokenmill.benchmarks.latency --model llama-3-8b -tp $tp --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
        --output-json "$OUT/lat_llama8b_tp$tp.json" 2>&1 | grep -E "^Avg|decode:|Error|error"
    done
    ;;
  s8e)  # decode attention and qk_norm_rope_store read metadata before the PDL wait: GPU tests, bs1 graph times
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_qk_norm_rope_store.py \
      tests/kernels/test_triton_attention.py > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -6
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== profile_steps $model --bs1-only"
      timeout 90 python3 tools/profile_steps.py $model --bs1-only > "$OUT/steps_$model.txt" 2>&1
      grep -vE "^(INFO|WARNING)" "$OUT/steps_$model.txt" | grep -E "ms per|back to back|Error" | head -6
    done
    ;;
  s8f)  # session 8's final code: GPU tests (kernels touched, greedy equality with HF) and the bs1 latency benches
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_qk_norm_rope_store.py tests/kernels/test_triton_fp8_kv.py tests/gpu/test_gpu_e2e.py \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== $model bs1"
      timeout 90 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$model.json" 2>&1 | grep -E "decode|Error"
    done
    ;;
  s9a)  # gemv with two W tiles in flight (GemvConfig.prefetch): GPU gemv tests, then the batch-1 sweep with it
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_gemv.py \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -6
    timeout 420 python3 tools/bench_gemv.py --shapes bs1 --ms 1 --deep --prefetch --no-rope --budget 300 \
      > "$OUT/sweep_bs1.txt" 2>&1; echo "sweep exit $?"
    grep -vE "^#   " "$OUT/sweep_bs1.txt" | tail -40
    ;;
  s9b)  # + FMA configs that reduce over K every step (acc2d): GPU gemv tests, Llama-3-8B and batch-1 sweeps
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_gemv.py \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -6
    timeout 280 python3 tools/bench_gemv.py --shapes l3bs1 --ms 1 --deep --prefetch --acc2d --no-rope --budget 200 \
      > "$OUT/sweep_l3.txt" 2>&1; echo "sweep exit $?"
    grep -vE "^#   " "$OUT/sweep_l3.txt" | sed -n '/== sweep/,$p'
    timeout 200 python3 tools/bench_gemv.py --shapes bs1 --ms 1 --deep --prefetch --acc2d --no-rope --budget 120 \
      > "$OUT/sweep_bs1.txt" 2>&1; echo "sweep exit $?"
    grep -vE "^#   " "$OUT/sweep_bs1.txt" | sed -n '/== sweep/,$p'
    ;;
  s9d)  # session 9's gemv table (prefetch / acc2d configs, down_proj and Llama lm_head on gemv): GPU tests, bs1 times
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_triton_gemv.py \
      tests/gpu/test_gpu_e2e.py > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    for model in qwen3-0.6b llama-3-8b; do
      echo "=== profile_steps $model --bs1-only"
      timeout 100 python3 tools/profile_steps.py $model --bs1-only > "$OUT/steps_$model.txt" 2>&1
      grep -vE "^(INFO|WARNING)" "$OUT/steps_$model.txt" | grep -E "ms per|back to back|Error" | head -6
      echo "=== $model bs1 bench latency"
      timeout 90 python3 -m tokenmill.benchmarks.latency --model $model --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$model.json" 2>&1 | grep -E "decode|Error"
    done
    ;;
  s9f)  # session 9's final code: the single-GPU GPU tests, Qwen3-0.6B bs1 latency and the nano-vllm throughput workload
    timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/layers tests/gpu \
      tests/worker > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    timeout 90 python3 -m tokenmill.benchmarks.latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 \
      --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3-0.6b.json" 2>&1 | grep -E "decode|Error"
    timeout 120 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    ;;
  s10b)  # where the batch-1 host loop's time goes (py-spy, collapsed stacks), then Llama-3-8B gemv A/B in the graph
    for m in qwen3-0.6b llama-3-8b; do
      timeout 150 /tmp/site/bin/py-spy record -r 200 --nonblocking --format raw -o "$OUT/pyspy_$m.txt" -- \
        python3 tools/graph_ab.py $m --host-seconds 8 2>&1 | grep -E "steps|Error|error" | tail -3
    done
    timeout 240 python3 tools/graph_ab.py llama-3-8b 2>&1 | grep -vE "^INFO" | tee "$OUT/ab_llama.txt" | tail -10
    ;;
  s10e)  # staged inputs + the draw inside the decode graph: GPU tests, host A/B (.ab/{old,new}, 2 cores), bs1 latency
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu tests/worker \
      tests/kernels/test_triton_placeholders.py tests/kernels/test_triton_sampling.py > "$OUT/gpu_pytest.txt" 2>&1
    echo "gpu pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    for v in new old new old; do  # same host, alternating: .ab/{old,new} hold the two versions (untracked)
      cp -r .ab/$v/tokenmill/. tokenmill/
      echo -n "$v: "; timeout 60 taskset -c 4,5 python3 tools/graph_ab.py qwen3-0.6b --rounds 1 --only none 2>&1 | grep -E "async|Error"
    done
    cp -r .ab/new/tokenmill/. tokenmill/
    timeout 90 python3 -m tokenmill.benchmarks.latency --model qwen3-0.6b --batch-size 1 --input-len 128 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json" 2>&1 | grep -E "decode|Error"
    ;;
  s10f)  # session 10's final code: kernel/layer GPU tests, bs1 latency (both shapes), the nano-vllm throughput workload
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels tests/layers \
      > "$OUT/gpu_pytest.txt" 2>&1; echo "gpu pytest exit $?"
    grep -E "passed|failed|Error|assert" "$OUT/gpu_pytest.txt" | tail -8
    for m in qwen3-0.6b llama-3-8b; do
      timeout 90 python3 -m tokenmill.benchmarks.latency --model $m --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_$m.json" 2>&1 | grep -E "decode|Error"
    done
    timeout 120 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    ;;
  s10g)  # the nano-vllm throughput workload, session 9's host path against session 10's, same host
    for v in ${2:-old new}; do
      cp -r .ab/$v/tokenmill/. tokenmill/
      echo -n "$v: "; timeout 110 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 \
        --input-len 562 --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
        --output-json "$OUT/tp_qwen3_$v.json" 2>&1 | grep -E "Throughput|Error"
    done
    ;;
  s11g)  # the session's final code: bs1 latency of both models, then the GPU tests of kernels, layers and engine
    for m in llama-3-8b qwen3-0.6b; do
      lat1 $m 60
    done
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels tests/layers tests/gpu \
      tests/worker 2>&1 | tail -8
    ;;
  s12f)  # Llama-3-8B batch-1 product configs in the graph at the targets' context, then each candidate against
          # float64
    ab llama-3-8b 200 c256 --context 256
    timeout 60 python3 tools/check_variant_configs.py llama-3-8b 2>&1 | tail -18
    ;;
  s13b)  # confirm's code: bs1 latency of both models, the Qwen3 workload at token budgets 8192 (then the default:
          # session 13's files say "default") and 16384 (vLLM's LLM-class default on 70+ GiB GPUs), the GPU tests
    lat1 llama-3-8b 50 s13b; lat1 qwen3-0.6b 50 s13b
    for mbt in 8192 16384; do
      echo "--- qwen3 throughput, max_num_batched_tokens $mbt"
      nano qwen3-0.6b 90 tp_qwen3_$mbt --max-num-batched-tokens $mbt
    done
    timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels tests/layers tests/gpu \
      tests/worker 2>&1 | tail -6
    ;;
  s13c)  # the Qwen3 workload at token budgets 8192 (session 13's files say "default") and 16384, alternating,
          # three runs each; Llama bs1
    for i in 1 2 3; do
      for mbt in 8192 16384; do
        echo "--- qwen3 throughput run $i, max_num_batched_tokens $mbt"
        nano qwen3-0.6b 70 tp_qwen3_${mbt}_$i --max-num-batched-tokens $mbt
      done
    done
    lat1 llama-3-8b 50 s13c
    ;;
  s13d)  # the offline LLM's 16384-token default on this GPU: the official throughput commands, unchanged
    nano qwen3-0.6b 70 tp_qwen3_1; nano qwen3-0.6b 70 tp_qwen3_2
    nano llama-3-8b 100 tp_llama8b
    ;;
  gun)  # (prepared in session 13, not run yet) Llama gate_up with the RMSNorm folded in, so no norm kernel, at the
        # session-12 gate_up configs, and qkv + norm with the x prefetch: float64 check of every variant config,
        # then the batch-1 graph A/B at ctx 256
    timeout 120 python3 tools/check_variant_configs.py llama-3-8b 2>&1 | tail -4
    ab llama-3-8b 280 gun --only base,gun-d128x128w8x,gun-d128x128w8x-st4,gun-d64x128w4x,qkvn-f16x512w8pax \
      --context 256
    ;;
  s14a)  # mode gun, then batch-1 latency end to end (tools/lat_variant.py) of base and the fastest gun-* variant
          # that beat base (with qkvn-f16x512w8pax too where that beat base), alternating (as run in session 14
          # it also took a gun-* variant that lost)
    "$0" gun
    best=$(awk '$1 ~ /^gun-/ && $3 ~ /^\(-/ {print $2, $1}' "$OUT/ab_llama-3-8b_gun.txt" | sort -n | head -1 \
      | cut -d' ' -f2)   # only one that beat base
    qx=$(awk '$1 == "qkvn-f16x512w8pax" && $3 ~ /^\(-/ {print "+qkvn-f16x512w8pax"}' "$OUT/ab_llama-3-8b_gun.txt")
    echo "best gate_up + norm variant: ${best:-none}${qx}"
    for v in "$best$qx" base "$best$qx" base; do
      [ -n "$best" ] || break
      timeout 60 python3 tools/lat_variant.py llama-3-8b "$v" --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 2>&1 | grep -E "^---|decode|Error"
    done
    ;;
  s14b)  # the x prefetch on each batch-1 product of both models: float64 check, then the graph A/B at ctx 256 (base
          # is the table with qkv + norm's x prefetch; qkvn-f16x512w8pa is the table before it)
    timeout 100 python3 tools/check_variant_configs.py llama-3-8b 2>&1 | tail -2
    timeout 60 python3 tools/check_variant_configs.py qwen3-0.6b 2>&1 | tail -3
    ab llama-3-8b 200 x --only qkvn-f16x512w8pa,o-x,gu-x,down-x,lm-x --context 256
    ab qwen3-0.6b 120 x --only gun-x,down-x,lm-x --context 256
    ;;
  s14c)  # session 14's final code: the Qwen3 workload as the machine's first GPU work and again later; Llama-3-8B
          # bs1 end to end, this table (base) against session 13's (old), alternating; Qwen3 bs1; the Llama
          # workload; cold start; the GPU tests
    nano qwen3-0.6b 100 tp_qwen3_first
    i=0
    for v in base o-old+gu-old+qkvn-f16x512w8pa base o-old+gu-old+qkvn-f16x512w8pa; do
      i=$((i + 1))
      timeout 60 python3 tools/lat_variant.py llama-3-8b "$v" --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_llama-3-8b_$i.json" 2>&1 \
        | grep -E "^---|decode|Error"
    done
    lat1 qwen3-0.6b 50
    nano qwen3-0.6b 100 tp_qwen3
    nano llama-3-8b 110 tp_llama8b
    cold_start
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels tests/layers tests/gpu \
      tests/worker 2>&1 | tail -6
    ;;
  s14d)  # the sampling rows 16-byte aligned: the Qwen3 workload on a fresh Triton cache (twice), Triton compiles
          # inside the timed run, Qwen3 bs1
    for c in 1 2; do TRITON_CACHE_DIR=/tmp/tc_fresh$c nano qwen3-0.6b 100 tp_qwen3_fresh$c; done
    timeout 150 python3 tools/profile_throughput.py qwen3-0.6b --no-profile 2>&1 | grep -E "output tok/s|compiled"
    lat1 qwen3-0.6b 50
    ;;
  s15a)  # where the batch-1 step's time goes between graph replays (profiled generate), both models
    timeout 150 python3 tools/step_gaps.py qwen3-0.6b --trace "$OUT/trace_qwen3.json.gz" 2>&1 | grep -vE "^INFO"
    timeout 150 python3 tools/step_gaps.py llama-3-8b 2>&1 | grep -vE "^INFO"
    ;;
  s15b)  # decode graphs reading / writing their step IO in pinned host memory: GPU tests, then bs1 latency with it
          # off / on, alternating, both models; where the Llama step's time goes now
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/kernels/test_triton_step_inputs.py \
      tests/kernels/test_triton_sampling.py tests/kernels/test_triton_placeholders.py tests/worker \
      tests/gpu/test_gpu_e2e.py 2>&1 | tail -8
    for r in 1 2; do TOKENMILL_GRAPH_HOST_IO=0 lat1 qwen3-0.6b 60 off$r; lat1 qwen3-0.6b 60 on$r; done
    for r in 1 2; do TOKENMILL_GRAPH_HOST_IO=0 lat1 llama-3-8b 80 off$r; lat1 llama-3-8b 80 on$r; done
    timeout 120 python3 tools/step_gaps.py llama-3-8b 2>&1 | grep -vE "^INFO"
    ;;
  s15c)  # final code (host IO on): the Qwen3 / Llama workloads, cold start, and the run(1) (prefill + first token)
          # difference host IO on / off seen in s15b, alternating
    for r in 1 2; do for m in 0 1; do TOKENMILL_GRAPH_HOST_IO=$m timeout 60 python3 tools/first_token_spread.py 2>&1 \
      | grep -E "^IO=|Error"; done; done
    nano qwen3-0.6b 100 tp_qwen3
    nano llama-3-8b 100 tp_llama8b
    cold_start
    lat1 qwen3-0.6b 50 final
    ;;
  s15d)  # the final code on a fresh host: every #4 target, HF last (the longest; cut first if the budget ends)
    lat1 llama-3-8b 60 confirm; lat1 qwen3-0.6b 40 confirm
    nano qwen3-0.6b 80 tp_qwen3_tokenmill_confirm
    nano llama-3-8b 90 tp_llama8b_confirm
    cold_start
    timeout 200 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --backend hf \
      --output-json "$OUT/tp_qwen3_hf_confirm.json" 2>&1 | grep -E "Throughput|Error"
    ;;
  confirm)  # every #4 target on one host in one call: the Qwen3 workload on tokenmill and on HF transformers (same
            # prompts, same run), bs1 latency of both models, the Llama workload, cold start
    lat1 llama-3-8b 50; lat1 qwen3-0.6b 50
    nano qwen3-0.6b 100 tp_qwen3_tokenmill
    # HF on the same prompts, batches of 256 (--hf-max-batch-size); it takes no --max-num-seqs
    timeout 260 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --backend hf \
      --output-json "$OUT/tp_qwen3_hf.json" 2>&1 | grep -E "Throughput|Error"
    nano llama-3-8b 100 tp_llama8b
    cold_start
    ;;
  s12h)  # (run as an inline command in session 12; the same steps) bs1 latency of both models on the final code
    lat1 llama-3-8b 50; lat1 qwen3-0.6b 50
    ;;
  s12g)  # Llama gate_up dot 128 x 128, 8 warps: bs1 latency, the gemv GPU tests
    lat1 llama-3-8b 60
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_gemv.py 2>&1 | tail -3
    ;;
  s12e)  # the session's final code: bs1 latency of both models, the throughput workloads, the GPU tests
    lat1 qwen3-0.6b 50; lat1 llama-3-8b 60
    timeout 110 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels tests/layers tests/gpu \
      tests/worker 2>&1 | tail -6
    timeout 130 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_llama8b.json" 2>&1 | grep -E "Throughput|Error"
    ;;
  s12d)  # idle decode splits leave before the PDL wait; split counts for batch 1 at the targets' and a long context
    ab qwen3-0.6b 170 ctx --context 256,1266
    ab llama-3-8b 250 ctx --context 256,1266
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_decode_rope_attention.py 2>&1 | tail -4
    ;;
  s12c)  # the new defaults (early gemv triggers, Llama qkv / o_proj entries): graph A/B against the old ones and
          # against other decode split counts at context 256, bs1 latency, the GPU tests of the kernels and end to end
    ab qwen3-0.6b 100 c256 --context 256
    ab llama-3-8b 150 c256 --context 256
    lat1 qwen3-0.6b 50; lat1 llama-3-8b 60
    timeout 190 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_gemv.py \
      tests/kernels/test_triton_attention.py tests/gpu/test_gpu_e2e.py 2>&1 | tail -6
    ;;
  s12b)  # at the latency targets' contexts (~256): Qwen3 fused decode with q/k norms, early gemv triggers, Llama
          # product configs in the graph; then the fused-decode kernel tests
    ab qwen3-0.6b 150 c256 --context 256
    ab llama-3-8b 320 c256 --context 256
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
      tests/kernels -k "pdl_chain or rope_attention" 2>&1 | tail -4
    ;;
  s12a)  # early PDL triggers (TOKENMILL_PDL_EARLY): graph A/B per model, then bs1 latency without / with the best
          # early set of each model, alternating
    ab llama-3-8b 230
    ab qwen3-0.6b 120
    for m in qwen3-0.6b llama-3-8b; do
      e=$(best_early $m); echo "best early set for $m: '$e'"
      lat1 $m 55 base; TOKENMILL_PDL_EARLY=$e lat1 $m 55 early
    done
    ;;
  s11f)  # norm prologue on the dot path (spill-free tiles) and x one K step ahead: graph A/B per model
    for m in llama-3-8b qwen3-0.6b; do
      ab $m 200
    done
    ;;
  s11e)  # SiLU in gate_up's epilogue: graph A/B per model, bs1 latency and the throughput workload on the defaults,
         # then the GPU tests of the changed kernels and the end-to-end GPU tests
    for m in llama-3-8b qwen3-0.6b; do
      ab $m 150
    done
    for m in qwen3-0.6b llama-3-8b; do
      lat1 $m 60
    done
    timeout 100 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
      --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
      --output-json "$OUT/tp_qwen3.json" 2>&1 | grep -E "Throughput|Error"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_gemv.py \
      tests/gpu/test_gpu_e2e.py 2>&1 | tail -8
    ;;
  s11d)  # decode attention from qkv, v2 (first K/V tile before the PDL wait, newest key in registers): graph A/B
         # with 4 / 8 warps against the separate rope kernel, then the GPU tests
    for m in qwen3-0.6b llama-3-8b; do
      ab $m 150
    done
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_decode_rope_attention.py \
      tests/gpu/test_gpu_e2e.py 2>&1 | tail -8
    ;;
  s11c)  # decode attention straight from qkv (rope/store folded into stage 1): graph A/B, bs1 latency, GPU tests
    for m in qwen3-0.6b llama-3-8b; do
      ab $m 150
    done
    for m in qwen3-0.6b llama-3-8b; do
      lat1 $m 60
    done
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_triton_decode_rope_attention.py \
      tests/kernels/test_triton_attention.py tests/gpu/test_gpu_e2e.py 2>&1 | tail -8
    ;;
  s11a)  # where to cut the in-graph draw (worker/cuda_graph.py SAMPLE_IN_GRAPH_MAX_SIZE): bs 1 and 16 latency and the
         # throughput workload per cut, same host (the constant is edited in this copy of the tree only)
    for cut in 0 16 256; do
      sed -i "s/^SAMPLE_IN_GRAPH_MAX_SIZE = .*/SAMPLE_IN_GRAPH_MAX_SIZE = $cut/" tokenmill/worker/cuda_graph.py
      echo "== cut $cut"
      for bs in 1 16; do
        timeout 60 python3 -m tokenmill.benchmarks.latency --model qwen3-0.6b --batch-size $bs --input-len 128 \
          --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 2>&1 | grep -E "decode|Error"
      done
      timeout 110 python3 -m tokenmill.benchmarks.throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 \
        --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 2>&1 | grep -E "Throughput|Error"
    done
    ;;
  s5h)  # on nvidia-h200-x2: the final symmetric all-reduce code: its GPU test and TP=2 equality
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/distributed/test_symm_all_reduce.py \
      "tests/distributed/test_tp_engine.py::test_tp2_on_two_gpus_matches_tp1" 2>&1 | tail -4
    ;;
  next4)  # on nvidia-h200-x2: Llama-3-8B TP=1 vs TP=2, bs1 latency and the nano-vllm throughput workload
    for tp in 1 2; do
      timeout 100 python3 -m tokenmill.benchmarks.latency --model llama-3-8b -tp $tp --batch-size 1 --input-len 128 \
        --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
        --output-json "$OUT/lat_llama8b_tp$tp.json" 2>&1 | grep -E "^Avg|decode:|Error|error"
      timeout 180 python3 -m tokenmill.benchmarks.throughput --model llama-3-8b -tp $tp --num-prompts 256 \
        --input-len 562 --output-len 562 --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 \
        --output-json "$OUT/tp_llama8b_tp$tp.json" 2>&1 | grep -E "Throughput|Error|error"
    done
    ;;
  bench-small)
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json"
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_qwen3.json"
    ;;
  final)
    export TOKENMILL_STEP_TIMING=1
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_qwen3.json"
    unset TOKENMILL_STEP_TIMING
    bench latency --model qwen3-0.6b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_qwen3.json"
    cold_start
    bench latency --model llama-3-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_llama8b.json"
    bench throughput --model llama-3-8b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_llama8b.json"
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --backend hf --output-json "$OUT/tp_qwen3_hf.json"
    ;;
  bench-full)
    bench latency --model llama-3-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/lat_llama8b.json"
    bench throughput --model llama-3-8b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --max-num-seqs 256 --output-json "$OUT/tp_llama8b.json"
    bench throughput --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
      --random-range-ratio 0.82 --max-model-len 2048 --backend hf --output-json "$OUT/tp_qwen3_hf.json"
    ;;
esac
