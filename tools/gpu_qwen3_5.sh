#!/usr/bin/env bash
# Qwen3.5 (hybrid Gated DeltaNet) figures on a GPU machine (issue 27), dummy weights, the shipped 27B shape.
# Usage: tools/gpu_qwen3_5.sh [decode] [long]   (no argument: both)
#   decode  bs1 decode ms per output token (`tokenmill bench latency`, 128 in / 128 out) against the HBM floor:
#           the bytes of every weight a token reads (all but the embedding table) / 4.25 TB/s (target <= 1.15x).
#   long    64 requests of 8k in / 512 out (`tokenmill bench throughput`) on the shape as shipped and on a copy
#           whose every layer is full attention (target: hybrid >= 1.5x), with the KV capacity at 32k tokens.
#           TAGS="hybrid" or "all_full" runs one of the two; LONG_EXTRA adds flags to both (on an 80 GB card
#           "--no-enable-prefix-caching": the hybrid's state checkpoints would otherwise take the KV cache's room).
# flash-linear-attention (wheels fla_core and flash_linear_attention) goes in .devcarry/ with the other wheels the
# machine lacks, as for tools/gpu_bench.sh; without it the layers run the PyTorch reference.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-decode long}
MODEL=${MODEL:-qwen3.5-27b}
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=tokenmill/model_configs/$MODEL
bench() { python3 -m tokenmill.entrypoints.cli.main bench "$@" 2>&1 | grep -E "decode:|Throughput|KV cache|Error|error|ready" ; }

decode() {
  python3 -c "import fla; print('flash-linear-attention', fla.__version__)" 2>/dev/null || echo "no flash-linear-attention"
  bench latency --model "$MODEL" --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 --num-iters-warmup 1 \
    --max-model-len 2048 --output-json "$OUT/qwen3_5_latency.json"
  python3 - "$SRC" "$OUT" <<'PY'
import json, os, sys
t = json.load(open(os.path.join(sys.argv[1], "config.json")))["text_config"]
h, L, i, V = t["hidden_size"], t["num_hidden_layers"], t["intermediate_size"], t["vocab_size"]
full = sum(x == "full_attention" for x in t["layer_types"])
hd, nq, nkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
attn = h * (2 * nq * hd + 2 * nkv * hd) + nq * hd * h          # q (with its gate), k, v, o
kd, vd = t["linear_num_key_heads"] * t["linear_key_head_dim"], t["linear_num_value_heads"] * t["linear_value_head_dim"]
lin = h * (2 * kd + 2 * vd + 2 * t["linear_num_value_heads"]) + vd * h + (2 * kd + vd) * t["linear_conv_kernel_dim"]
params = full * attn + (L - full) * lin + L * 3 * h * i + V * h   # + the untied head
floor_ms = 2 * params / 4.25e12 * 1e3
ms = json.load(open(os.path.join(sys.argv[2], "qwen3_5_latency.json")))["decode_ms_per_token"]
print(f"bs1 decode {ms:.2f} ms/token; HBM floor {floor_ms:.2f} ms ({2 * params / 1e9:.1f} GB read per token); "
      f"ratio {ms / floor_ms:.3f} (target <= 1.15)")
PY
}

long() {
  local full=/tmp/q35_all_full
  python3 - "$SRC" "$full" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1:3]
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
cfg = json.load(open(os.path.join(dst, "config.json")))
cfg["text_config"]["layer_types"] = ["full_attention"] * cfg["text_config"]["num_hidden_layers"]
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
PY
  for tag in ${TAGS:-hybrid all_full}; do
    path=$SRC; [ "$tag" = all_full ] && path=$full
    echo "=== $tag: 64 x 8192 in / 512 out"
    bench throughput --model "$path" --load-format dummy --num-prompts 64 --input-len 8192 --output-len 512 \
      --max-model-len 8800 --max-num-seqs 64 ${LONG_EXTRA:-} --output-json "$OUT/qwen3_5_long_$tag.json"
  done
}

for part in $PARTS; do "$part"; done
