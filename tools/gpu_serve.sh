#!/usr/bin/env bash
# Serving figures on a GPU machine (issue 25): start-up time of `tokenmill serve` (cold, then warm with Triton's
# cache filled), online load at two concurrencies (completions and streaming chat) against offline throughput on
# the same request set. Dummy weights of a shipped shape (default llama-3-8b), prefix caching off, random
# prompts of INPUT_LEN tokens, OUTPUT_LEN out, NUM prompts; the tokenizer is .devcarry/tokenizer (any tokenizer does
# for random token prompts). Wheels the machine lacks (fastapi, uvicorn, pydantic, ...) go in .devcarry/.
# Usage: tools/gpu_serve.sh [startup] [load]   (no argument: both)
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-startup load}
MODEL=${MODEL:-llama-3-8b}; SRC=${SRC:-tokenmill/model_configs/$MODEL}
INPUT_LEN=${INPUT_LEN:-1024}; OUTPUT_LEN=${OUTPUT_LEN:-128}; NUM=${NUM:-500}; CONC=${CONC:-64 256}
BACKENDS=${BACKENDS:-openai openai-chat}; OFFLINE=${OFFLINE:-1}  # OFFLINE=0: no offline reference runs
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TM="python3 -m tokenmill.entrypoints.cli.main"
SERVE_ARGS="$SRC --load-format dummy --tokenizer .devcarry/tokenizer --port 8011 --max-model-len 2048 \
--no-enable-prefix-caching ${SERVE_EXTRA:-}"
PID=

start_server() {  # start_server TAG: starts, waits for /health, prints seconds to ready
  local t0; t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  $TM serve $SERVE_ARGS >"$OUT/serve_$1.log" 2>&1 &
  PID=$!
  python3 - "$t0" "$1" "$PID" <<'PY'
import os, sys, time, urllib.request
t0, tag, pid = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
alive = lambda: os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
while time.time() - t0 < 300 and alive():
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=1)
        print(f"serve {tag}: ready in {time.time() - t0:.1f} s", flush=True); break
    except Exception:
        time.sleep(0.2)
else:
    print(f"serve {tag}: not ready after {time.time() - t0:.0f} s"); sys.exit(1)
PY
  local ok=$?
  grep -E "Server ready|Engine ready|Loaded|KV cache:|Memory:|Traceback|Error" "$OUT/serve_$1.log" | cut -c1-400
  [ $ok = 0 ] || { tail -5 "$OUT/serve_$1.log" | cut -c1-300; return 1; }
}

stop_server() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=; }

startup() {
  start_server cold; stop_server
  start_server warm; stop_server
}

load() {
  start_server load || return 1
  for c in $CONC; do
    for be in $BACKENDS; do
      echo "=== serve $be concurrency $c"
      $TM bench serve --port 8011 --backend $be --dataset-name random --random-input-len "$INPUT_LEN" \
        --random-output-len "$OUTPUT_LEN" --random-range-ratio 0 --num-prompts "$NUM" --max-concurrency "$c" \
        --ignore-eos --tokenizer .devcarry/tokenizer --disable-tqdm --output-json "$OUT/serve_${be}_c$c.json" 2>&1 \
        | grep -E "throughput|TTFT|TPOT|ITL|Successful|Failed" | grep -vE "^P(25|75|90)"
    done
  done
  stop_server
  [ "$OFFLINE" = 1 ] || return 0
  for c in $CONC; do
    echo "=== offline, max-num-seqs $c"
    $TM bench throughput --model "$SRC" --load-format dummy --num-prompts "$NUM" --input-len "$INPUT_LEN" \
      --output-len "$OUTPUT_LEN" --random-range-ratio 0 --max-model-len 2048 --max-num-seqs "$c" \
      --no-enable-prefix-caching --output-json "$OUT/offline_c$c.json" 2>&1 | grep -E "tok/s|Throughput" | tail -2
  done
}

for w in $PARTS; do "$w"; done
