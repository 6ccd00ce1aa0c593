#!/usr/bin/env bash
# Speculative decoding on a GPU machine (issue 29), 8B shape, dummy weights, k = 4 (K to change).
# Usage: tools/gpu_spec.sh [tests] [latency]   (no argument: both)
#   tests    pytest -m gpu tests/gpu/test_gpu_spec_decode.py, then tests/spec_decode on CUDA
#   latency  bs1 decode (BS to change), 128 in / 256 out: no drafts; ngram and a draft model (the llama-3.2-1b
#            shape) at a fixed acceptance rate of 0.9 per draft (benchmark_acceptance_rate: ~3.1 of 4 kept per
#            step) and of 0 (the mechanism's cost when nothing is accepted)
# Wheels the machine lacks go in .devcarry/, as for tools/gpu_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-tests latency}
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -d .devcarry/tokenizer ] && export TOKENMILL_TEST_TOKENIZER_DIR="$PWD/.devcarry/tokenizer"
K=${K:-4}; BS=${BS:-1}
for part in $PARTS; do
  if [ "$part" = tests ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_spec_decode.py 2>&1 | tail -15
    python3 -m pytest -q -p no:cacheprovider -x tests/spec_decode 2>&1 | tail -5
  elif [ "$part" = latency ]; then
    B="python3 -m tokenmill.entrypoints.cli.main bench latency --model llama-3-8b --batch-size $BS --input-len 128
       --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --temperature 0"
    echo "=== no drafts"; $B 2>&1 | grep -E "Avg latency|per token|Error|error" | tail -3
    for rate in 0.9 0; do
      for spec in '"method": "ngram"' '"model": "llama-3.2-1b"'; do
        echo "=== $spec rate $rate"
        $B --speculative-config "{$spec, \"num_speculative_tokens\": $K, \"benchmark_acceptance_rate\": $rate}" \
          2>&1 | grep -E "Avg latency|per token|spec_decode|Error|error" | tail -4
      done
    done
  fi
done
