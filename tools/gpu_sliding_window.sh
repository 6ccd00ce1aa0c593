#!/usr/bin/env bash
# Sliding-window figures on a GPU machine (issue 27), dummy weights, the shipped Gemma-3-4B text shape by default.
# Usage: tools/gpu_sliding_window.sh [blocks] [decode]   (no argument: both)
#   blocks  one 32k-token request (32000 prompt tokens + 256 out, chunked prefill): the most KV blocks it holds at
#           once, for the shape as shipped (five window-1024 layers to one global) and for a copy with every layer
#           global (its `sliding_window` removed); prints the ratio (target: at most 0.30).
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
GLOBAL=/tmp/sw_configs/$MODEL-all-global

make_global() {
  python3 - "$SRC" "$GLOBAL" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
cfg = json.load(open(os.path.join(dst, "config.json")))
cfg["sliding_window"] = None
cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
PY
}

blocks() {
  make_global
  python3 - "$SRC" "$GLOBAL" "$OUT" <<'PY'
import json, os, sys, time
import numpy as np
from tokenmill import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
src, glob, out = sys.argv[1:4]
PROMPT, GEN = int(os.environ.get("PROMPT_LEN", "32000")), int(os.environ.get("GEN_LEN", "256"))
res = {}
for tag, path in (("windowed", src), ("all_global", glob)):
    eng = LLMEngine.from_engine_args(model=path, load_format="dummy", max_model_len=PROMPT + GEN + 16,
                                     max_num_seqs=1, max_num_batched_tokens=8192, enable_chunked_prefill=True,
                                     enable_prefix_caching=False, gpu_memory_utilization=0.85,
                                     skip_tokenizer_init=True)
    kv = eng.engine_core.scheduler.kv
    ids = np.random.default_rng(0).integers(10, 200000, PROMPT).tolist()
    eng.add_request("r", {"prompt_token_ids": ids},
                    SamplingParams(max_tokens=GEN, ignore_eos=True, temperature=0, detokenize=False))
    most, t = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, kv.num_blocks - kv.num_free_blocks())
    res[tag] = {"max_blocks_held": most, "num_blocks": kv.num_blocks, "seconds": time.perf_counter() - t}
    print(f"{tag}: at most {most} KV blocks held of {kv.num_blocks} ({res[tag]['seconds']:.1f} s)")
    del eng
    import gc, torch
    gc.collect(); torch.cuda.empty_cache()
ratio = res["windowed"]["max_blocks_held"] / res["all_global"]["max_blocks_held"]
print(f"windowed / all-global KV blocks for one {PROMPT + GEN}-token request: {ratio:.3f} (target <= 0.30)")
res["ratio"] = ratio
json.dump(res, open(os.path.join(out, "sliding_window_blocks.json"), "w"), indent=1)
PY
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
