#!/usr/bin/env bash
# Sliding-window figures on a GPU machine (issue 27), dummy weights, the shipped Gemma-3-4B text shape by default.
# Usage: tools/gpu_sliding_window.sh [blocks] [decode]   (no argument: both)
#   blocks  one 32k-token request (32000 prompt tokens + 256 out, chunked prefill): the most KV bytes it holds at
#           once against every layer global, at budgets 2048 and 8192 (`tokenmill bench kv-footprint`; target:
#           at most 0.30). Needs no GPU.
#   decode  bs1 decode ms per output token at a 32k context and at a 1k one (`tokenmill bench latency`, 128 out);
#           prints the ratio (target: 32k within 10% of 1k).
# Results go to $OUT (default /tmp/out) as JSON. Wheels the machine lacks go in .devcarry/, as for tools/gpu_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-blocks decode}
MODEL=${MODEL:-gemma-3-4b}
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENMILL_LOGGING_LEVEL=${TOKENMILL_LOGGING_LEVEL:-INFO}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=${SRC:-tokenmill/model_configs/$MODEL}
blocks() {  # device-free: the engine's scheduler and KV managers with a fake runner, bytes per layer group
  python3 -m tokenmill.entrypoints.cli.main bench kv-footprint --model "$SRC" --prompt-len "${PROMPT_LEN:-32000}" \
    --output-len "${GEN_LEN:-256}" --output-json "$OUT/sliding_window_blocks.json" 2>&1 | grep -v Warn
}

decode() {
  for ctx in 1000 32000; do
    echo "=== bs1 decode at a $ctx-token context"
    python3 -m tokenmill.entrypoints.cli.main bench latency --model "$MODEL" --load-format dummy \
      --batch-size 1 --input-len $ctx --output-len 128 --num-iters 3 --num-iters-warmup 1 --max-model-len 33000 \
      --max-num-batched-tokens 8192 --output-json "$OUT/sliding_window_decode_$ctx.json" 2>&1 \
      | grep -E "decode:|Error|error|KV cache" | tail -4
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
ms = {c: json.load(open(os.path.join(out, f"sliding_window_decode_{c}.json")))["decode_ms_per_token"]
      for c in (1000, 32000)}
print(f"decode ms/token: 1k {ms[1000]:.3f}, 32k {ms[32000]:.3f}, ratio {ms[32000] / ms[1000]:.3f} (target <= 1.10)")
PY
}

for part in $PARTS; do
  "$part"
done
