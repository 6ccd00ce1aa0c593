#!/usr/bin/env bash
# Quantized-weight and multi-LoRA figures on a GPU machine (issues 26 and 28), dummy weights, 8B shape by default.
# Usage: tools/gpu_quant_lora.sh [quant] [lora]   (no argument: both)
#   quant  bs1 decode (128 in / 128 out) for bf16, online fp8, fp8 checkpoint (per-tensor and 128x128 blocks),
#          AWQ and GPTQ 4-bit (group 128): a copy of the shipped config with a quantization_config added, so the
#          weights are packed in each format (dummy values).
#   lora   random rank-16 PEFT adapters (all seven projections): bs1 decode with one adapter against the base, and
#          the nano-vllm workload (256 requests, lengths uniform in 101..1023) with 8 adapters round-robin
#          (max_loras 8), with 1 adapter, and without.
# Wheels the machine lacks go in .devcarry/, as for tools/gpu_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-quant lora}
MODEL=${MODEL:-llama-3-8b}
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENMILL_LOGGING_LEVEL=${TOKENMILL_LOGGING_LEVEL:-WARNING}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=${SRC:-tokenmill/model_configs/$MODEL}
Q=/tmp/quant_configs; mkdir -p $Q

quant() {
  python3 - "$SRC" "$Q" <<'PY'
import json, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
kinds = {"fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
         "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
         "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
         "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}
for k, q in kinds.items():
    d = os.path.join(dst, k)
    shutil.rmtree(d, ignore_errors=True); shutil.copytree(src, d)
    cfg = json.load(open(os.path.join(d, "config.json"))); cfg["quantization_config"] = q
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
PY
  for spec in "bf16:$MODEL:" "fp8-online:$MODEL:--quantization fp8" "fp8:$Q/fp8:" "fp8-block:$Q/fp8-block:" \
              "awq:$Q/awq:" "gptq:$Q/gptq:"; do
    IFS=: read -r tag path extra <<<"$spec"
    echo "=== bs1 $tag"
    # shellcheck disable=SC2086
    python3 -m tokenmill.entrypoints.cli.main bench latency --model "$path" $extra --load-format dummy \
      --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
      --output-json "$OUT/quant_bs1_$tag.json" 2>&1 | grep -E "decode:|Error|error" | tail -3
  done
}

lora() {
  for mode in base lora; do python3 - "$SRC" "$OUT" $mode <<'PY'
import json, os, sys, time
import torch
from safetensors.torch import save_file
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest
from tokenmill.benchmarks.offline_common import random_token_prompts
src, out, mode = sys.argv[1:4]
NUM = int(os.environ.get("NUM_PROMPTS", "256"))
cfg = json.load(open(os.path.join(src, "config.json")))
H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
kv = cfg["num_key_value_heads"] * hd
shapes = {"q_proj": (H, cfg["num_attention_heads"] * hd), "k_proj": (H, kv), "v_proj": (H, kv),
          "o_proj": (cfg["num_attention_heads"] * hd, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
R = 16
def make_adapter(i):
    d = f"/tmp/adapters/a{i}"; os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(i); t = {}
    for l in range(L):
        for m, (k, n) in shapes.items():
            grp = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{l}.{grp}.{m}"
            t[f"{p}.lora_A.weight"] = (torch.randn(R, k, generator=g) / k ** 0.5).to(torch.bfloat16)
            t[f"{p}.lora_B.weight"] = (torch.randn(n, R, generator=g) * 1e-3).to(torch.bfloat16)
    save_file(t, f"{d}/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 32, "target_modules": list(shapes), "bias": "none",
               "base_model_name_or_path": src}, open(f"{d}/adapter_config.json", "w"))
    return d
kw = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=256, seed=0)
if mode == "lora":
    t0 = time.perf_counter(); paths = [make_adapter(i) for i in range(8)]
    print(f"made 8 adapters in {time.perf_counter() - t0:.1f} s", flush=True)
    kw.update(enable_lora=True, max_loras=8, max_lora_rank=R)
llm = LLM(src, **kw)
reqs = lambda ps: [{"prompt_token_ids": p} for p in ps]
res = {}
# bs1 decode: 128 in / 128 out, ms per output token from two lengths' difference.
def bs1(lora):
    p = reqs(random_token_prompts(1, 128, 128, 0.0, cfg["vocab_size"], 1)[0])
    ts = {}
    for n in (2, 130):
        sp = SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0)
        llm.generate(p, sp, lora_request=lora, use_tqdm=False)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter(); llm.generate(p, sp, lora_request=lora, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        ts[n] = best
    return (ts[130] - ts[2]) / 128 * 1e3
prompts, lens = random_token_prompts(NUM, 562, 562, 0.82, cfg["vocab_size"], 0)
params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0) for n in lens]
def nano(tag, loras):
    llm.generate(reqs(prompts[:8]), params[:8], lora_request=None if loras is None else loras[:8], use_tqdm=False)
    t = time.perf_counter(); outs = llm.generate(reqs(prompts), params, lora_request=loras, use_tqdm=False)
    res[f"nano_{tag}_tok_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t), 1)
    print(tag, res[f"nano_{tag}_tok_s"], flush=True)
if mode == "base":
    res["bs1_base_ms"] = round(bs1(None), 3); nano("base", None)
else:
    lr = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(8)]
    one = SamplingParams(max_tokens=1, detokenize=False)
    t = time.perf_counter(); llm.generate(reqs([[1, 2, 3]]), one, lora_request=lr[0], use_tqdm=False)
    res["first_use_adapter_s"] = round(time.perf_counter() - t, 3)
    res["bs1_lora_enabled_no_adapter_ms"] = round(bs1(None), 3); res["bs1_lora1_ms"] = round(bs1(lr[0]), 3)
    print(res, flush=True)
    nano("lora1", [lr[0]] * NUM); nano("lora8", [lr[i % 8] for i in range(NUM)])
print(json.dumps(res)); json.dump(res, open(os.path.join(out, f"lora_{mode}.json"), "w"))
PY
  done
}

for w in $PARTS; do "$w"; done
