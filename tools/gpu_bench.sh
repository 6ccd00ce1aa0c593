#!/usr/bin/env bash
# The standard benchmark set on a GPU machine; the figures of docs/benchmarks.md come from it.
# Usage: tools/gpu_bench.sh [latency] [throughput] [tests]   (no argument: all three, in that order)
#   latency     bs1 decode, 128 prompt tokens, 256 out, of the Llama-3-8B and Qwen3-0.6B shapes
#   throughput  the nano-vllm workload (256 requests, lengths uniform in 101..1022, seed 0) on both shapes,
#               greedy and sampled (temperature 0.6, top-p 0.95)
#   tests       pytest -m gpu tests
# Shapes are the config-only models shipped in tokenmill/model_configs/, run with dummy weights (nothing to
# download). Each benchmark's JSON goes to $OUT (default /tmp/out), named after it; its log lines to stdout.
#
# The GPU machine has torch, triton and transformers but not msgspec or gguf, and no network. Put their wheels
# (for its Python) in .devcarry/ at the repository root, and optionally a saved tokenizer directory as
# .devcarry/tokenizer (the tests' TOKENMILL_TEST_TOKENIZER_DIR); carry .devcarry/ with the working tree. The
# wheels are installed into /tmp/site, which goes on PYTHONPATH next to this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-latency throughput tests}
for w in $PARTS; do
  case "$w" in latency|throughput|tests) ;; *) echo "unknown part '$w' (latency, throughput, tests)" >&2; exit 2 ;; esac
done
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1 \
    || echo "warning: installing .devcarry/*.whl failed" >&2
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -d .devcarry/tokenizer ] && export TOKENMILL_TEST_TOKENIZER_DIR="$PWD/.devcarry/tokenizer"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', t.__version__)"
MODELS=${MODELS:-llama-3-8b qwen3-0.6b}  # override to run a subset, e.g. MODELS=qwen3-0.6b
bench() { python3 -m tokenmill.entrypoints.cli.main bench "$@" 2>&1 | grep -vE "^INFO|Processed prompts"; }

latency() {
  for m in $MODELS; do
    echo "=== bs1 latency $m"
    bench latency --model "$m" --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
      --num-iters-warmup 1 --max-model-len 2048 --output-json "$OUT/latency_$m.json"
  done
}

throughput() {
  for m in $MODELS; do
    for mode in greedy sampled; do
      sampling="--temperature 0"
      [ "$mode" = sampled ] && sampling="--temperature 0.6 --top-p 0.95"
      echo "=== nano-vllm throughput $m $mode"
      # shellcheck disable=SC2086
      bench throughput --model "$m" --num-prompts 256 --input-len 562 --output-len 562 --random-range-ratio 0.82 \
        --max-model-len 2048 --max-num-seqs 256 $sampling --output-json "$OUT/throughput_${m}_$mode.json"
    done
  done
}

tests() { echo "=== pytest -m gpu tests"; python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -25; }

for w in $PARTS; do "$w"; done
