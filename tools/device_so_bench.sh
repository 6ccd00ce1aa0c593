#!/usr/bin/env bash
# Structured-outputs serving benchmark (issue 5) on the GPU machine. Usage: bash tools/device_so_bench.sh
# Carry .devcarry/ (wheels for the server stack + xgrammar, and smollm2-dummy/: the SmolLM2-135M-Instruct config with
# its real tokenizer, served with --load-format dummy). Writes JSON results and the server log to $OUT.
#
# Runs: warm-up (free requests, then a few regex-constrained ones so xgrammar's tokenizer tables exist; the JSON
# schemas stay uncompiled until the measured mixed run), then at --max-concurrency 32 with the same random prompts:
#   free.json   only free requests (ignore_eos, fixed output length)
#   mixed.json  --structured-output-ratio 0.5: every second request carries one of 12 JSON schemas
#   free2.json  only free requests again, to show run-to-run noise
#   replay.json the mixed run's requests with its output lengths, all unconstrained (ignore_eos): the fair baseline,
#               since short structured answers make requests come and go (prefill steps) more often than free ones
# and prints: free median TPOT alone vs in the mixed run (slowdown %), structured / free median TPOT.
# Constrained answers use disable_any_whitespace: with random weights the default JSON grammar lets the model emit
# whitespace until max_tokens; compact JSON makes every answer end, and the report checks each against its schema.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL="$PWD/.devcarry/smollm2-dummy"
PORT=18000
CONC=32
NUM_PROMPTS=320
INPUT_LEN=256
OUTPUT_LEN=256

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "
import torch, triton, transformers, xgrammar, fastapi, uvicorn, zmq, pydantic, msgspec
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" || exit 1

# SO_DIAG=1: the server logs steps slower than 15 ms (with their phases and batch), event-loop stalls and slow GCs,
# and Triton kernels compiled after the warm-up are listed at the end (a fresh TRITON_CACHE_DIR).
if [ "${SO_DIAG:-0}" = 1 ]; then
  export TOKENMILL_SLOW_STEP_MS=15 TOKENMILL_LOOP_LAG_MS=15 TOKENMILL_GC_DEBUG=1 TOKENMILL_GC_DEBUG_MS=10
  export TRITON_CACHE_DIR=/tmp/so_tcache
  rm -rf "$TRITON_CACHE_DIR"
fi
setsid python3 -m tokenmill.entrypoints.cli.main serve "$MODEL" --load-format dummy --host 127.0.0.1 --port $PORT \
  --max-model-len 2048 > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
  kill -TERM -- -"$SERVER" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- -"$SERVER" 2>/dev/null
}
trap stop_server EXIT

t0=$(date +%s)
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null
do
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "server exited:"; tail -40 "$OUT/server.log"; exit 1; fi
  if (( $(date +%s) - t0 > 400 )); then echo "server not healthy after 400 s:"; tail -40 "$OUT/server.log"; exit 1; fi
  sleep 2
done
echo "server healthy after $(( $(date +%s) - t0 )) s"
grep -E "KV cache|Captured|Loaded" "$OUT/server.log" | head -5

bench() {  # bench NAME [extra flags]
  local name=$1; shift
  echo "=== $name $*"
  python3 -m tokenmill.entrypoints.cli.main bench serve --port $PORT --tokenizer "$MODEL" --dataset-name random \
    --random-input-len $INPUT_LEN --random-output-len $OUTPUT_LEN --max-concurrency $CONC --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm \
    --output-json "$OUT/$name.json" "$@" 2>&1 | grep -v "^Result written"
}
WARM=$(mktemp -d)
OUT="$WARM" bench warmup --num-prompts 96 > "$WARM/warmup.txt"
OUT="$WARM" bench warmup_regex --num-prompts 16 --structured-output-ratio 0.5 --structured-output-kind regex \
  --structured-output-disable-any-whitespace > "$WARM/warmup_regex.txt"
grep -m2 -E "^(Successful|Failed) requests" "$WARM"/warmup*.txt
rm -rf "$WARM"
touch /tmp/so_after_warmup
# SO_PYSPY=1: sample the server's processes (API server and engine core) with py-spy during the mixed and replay
# runs; collapsed stacks go to $OUT/spy_{mixed,replay}.txt (py-spy travels as a wheel in .devcarry/).
spied() {  # spied NAME [bench flags]
  local name=$1 spy=""
  if [ "${SO_PYSPY:-0}" = 1 ]; then
    /tmp/site/bin/py-spy record --pid "$SERVER" --subprocesses --rate 200 --format raw --nonblocking \
      -o "$OUT/spy_$name.txt" > "$OUT/.spy_$name.log" 2>&1 &
    spy=$!
    sleep 1
  fi
  echo "--- $1 starts at $(date +%T.%N | cut -c1-12)"
  bench "$@"
  echo "--- $1 ends at $(date +%T.%N | cut -c1-12)"
  if [ -n "$spy" ]; then kill -INT $spy; wait $spy; tail -2 "$OUT/.spy_$name.log"; rm -f "$OUT/.spy_$name.log"; fi
}
bench free --num-prompts $NUM_PROMPTS
spied mixed --num-prompts $NUM_PROMPTS --structured-output-ratio 0.5 --structured-output-disable-any-whitespace
[ "${SO_NOISE_RUN:-1}" = 1 ] && bench free2 --num-prompts $NUM_PROMPTS
# The same prompts, arrivals and output lengths as the mixed run, without the constraints: isolates their cost.
spied replay --num-prompts $NUM_PROMPTS --replay-output-lens "$OUT/mixed.json"

python3 - "$OUT" "$CONC" <<'EOF'
import json, os, sys
out, conc = sys.argv[1], sys.argv[2]
load = lambda n: json.load(open(os.path.join(out, n + ".json")))
free, mixed = load("free"), load("mixed")
free2 = load("free2") if os.path.exists(os.path.join(out, "free2.json")) else free
s, f = mixed["structured"], mixed["free"]
slow = lambda a, b: 100.0 * (b / a - 1.0)
summary = {
    "free_alone_median_tpot_ms": free["median_tpot_ms"], "free_mixed_median_tpot_ms": f["median_tpot_ms"],
    "free_alone_again_median_tpot_ms": free2["median_tpot_ms"],
    "free_slowdown_median_tpot_pct": slow(free["median_tpot_ms"], f["median_tpot_ms"]),
    "free_slowdown_mean_tpot_pct": slow(free["mean_tpot_ms"], f["mean_tpot_ms"]),
    "free_slowdown_median_itl_pct": slow(free["median_itl_ms"], f["median_itl_ms"]),
    "noise_free_vs_free2_median_tpot_pct": slow(free["median_tpot_ms"], free2["median_tpot_ms"]),
    "structured_median_tpot_ms": s["median_tpot_ms"],
    "structured_free_tpot_ratio": mixed["structured_free_tpot_ratio"],
    "structured_valid_output_rate": s["valid_output_rate"],
    "structured_mean_output_tokens": s["total_output_tokens"] / max(s["completed"], 1),
    "median_ttft_ms": {"free_alone": free["median_ttft_ms"], "free_mixed": f["median_ttft_ms"],
                       "structured": s["median_ttft_ms"]},
    "failed": {"free": free["failed"], "mixed": mixed["failed"], "free2": free2["failed"]},
    "output_throughput": {"free": free["output_throughput"], "mixed": mixed["output_throughput"]},
}
summary["pass_free_slowdown_lt_10pct"] = summary["free_slowdown_median_tpot_pct"] < 10.0
ratio = summary["structured_free_tpot_ratio"]
summary["pass_structured_tpot_le_1_3x"] = ratio is not None and ratio <= 1.3
replay = load("replay")


def tpots(run, idx):
    out = []
    for i in idx:
        n = run["output_lens"][i]
        if n > 1:
            out.append(1000.0 * (run["e2els"][i] - run["ttfts"][i]) / (n - 1))
    return sorted(out)


med = lambda xs: xs[len(xs) // 2] if xs else float("nan")
flags = mixed["structured_flags"]
free_idx = [i for i, x in enumerate(flags) if not x]
so_idx = [i for i, x in enumerate(flags) if x]
fm, fr = med(tpots(mixed, free_idx)), med(tpots(replay, free_idx))
sm, sr = med(tpots(mixed, so_idx)), med(tpots(replay, so_idx))
summary.update({
    "replay_free_median_tpot_ms": fr, "mixed_free_median_tpot_ms_per_request": fm,
    "free_slowdown_vs_replay_pct": slow(fr, fm),
    "replay_structured_slots_median_tpot_ms": sr, "mixed_structured_median_tpot_ms_per_request": sm,
    "structured_vs_unconstrained_same_requests_pct": slow(sr, sm),
    "pass_free_slowdown_vs_replay_lt_10pct": slow(fr, fm) < 10.0,
})
print(f"=== fair baseline (replay: same requests and lengths, no constraints): free median TPOT {fr:.3f} ms -> "
      f"{fm:.3f} ms with half the requests constrained ({slow(fr, fm):+.1f}%); the constrained requests "
      f"{sr:.3f} -> {sm:.3f} ms ({slow(sr, sm):+.1f}%)")
json.dump(summary, open(os.path.join(out, "so_summary.json"), "w"), indent=2)
print(f"=== summary (concurrency {conc}, 50/50 mixed = every second request has a JSON schema)")
print(f"free median TPOT alone {free['median_tpot_ms']:.3f} ms, in the mixed run {f['median_tpot_ms']:.3f} ms: "
      f"slowdown {summary['free_slowdown_median_tpot_pct']:+.1f}% (mean TPOT {summary['free_slowdown_mean_tpot_pct']:+.1f}%, "
      f"median ITL {summary['free_slowdown_median_itl_pct']:+.1f}%); free-only rerun {free2['median_tpot_ms']:.3f} ms "
      f"({summary['noise_free_vs_free2_median_tpot_pct']:+.1f}% noise)")
print(f"structured median TPOT {s['median_tpot_ms']:.3f} ms = {ratio if ratio is None else round(ratio, 3)}x free; "
      f"valid answers {s['valid_outputs']}/{s['completed']}, {summary['structured_mean_output_tokens']:.1f} tokens each")
print(f"failed requests: {summary['failed']}")
print(f"acceptance: free slowdown < 10%: {summary['pass_free_slowdown_lt_10pct']}; "
      f"structured TPOT <= 1.3x free: {summary['pass_structured_tpot_le_1_3x']}")
EOF
grep -iE "error|traceback" "$OUT/server.log" | head -5
if [ "${SO_DIAG:-0}" = 1 ]; then
  echo "=== Triton kernels compiled after the warm-up"
  find "$TRITON_CACHE_DIR" -name "*.json" -newer /tmp/so_after_warmup -printf "%TT %f\n" | grep -v __grp | sort
  echo "=== slow steps / loop stalls / GCs (server log), by kind"
  grep -cE "Slow step" "$OUT/server.log"; grep -cE "Event loop blocked" "$OUT/server.log"
  grep -E "Slow step|Event loop blocked|gc: generation|--- " "$OUT/server.log" | cut -c1-260 | tail -70
fi
exit 0
