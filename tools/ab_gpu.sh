#!/usr/bin/env bash
# Before/after on one GPU: an old tree of the package against the working tree, alternating per workload.
# Usage (on the GPU machine, in the repository root): tools/ab_gpu.sh OLD_TREE [STEP ...]
#   OLD_TREE  a directory holding an older `tokenmill/` package, e.g. `git archive <commit> tokenmill | tar -x -C old`
#   STEP      lat:MODEL (bs1 decode, 128 in / 256 out) or nano:MODEL:TAG (the nano-vllm workload: 256 requests,
#             lengths uniform in 101..1023, seed 0, ignore_eos), TAG one of greedy, sample (temperature 0.6,
#             top-p 0.95), topk (temperature 0.7, top-k 20, top-p 0.8), minp (temperature 0.6, min-p 0.05);
#             MODEL a shipped shape (qwen3-0.6b, llama-3-8b). Default: bs1 latency and the greedy and sample
#             workloads on both shapes; name the topk / minp steps to run them.
# The workload runs through the offline LLM API (not `bench throughput`), so trees whose bench lacks --top-p
# compare too. Wheels the machine lacks (msgspec, gguf, pyzmq) go in .devcarry/, as for tools/gpu_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=$(cd "$1" && pwd); shift
STEPS=${*:-lat:qwen3-0.6b lat:llama-3-8b nano:qwen3-0.6b:greedy nano:qwen3-0.6b:sample nano:llama-3-8b:greedy \
nano:llama-3-8b:sample}
if ls .devcarry/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/*.whl >/dev/null 2>&1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENMILL_LOGGING_LEVEL=WARNING
NEW=$PWD
NANO='
import json, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir
model, tag = sys.argv[1], sys.argv[2]
sampling = {"greedy": dict(temperature=0.0), "sample": dict(temperature=0.6, top_p=0.95),
            "topk": dict(temperature=0.7, top_k=20, top_p=0.8), "minp": dict(temperature=0.6, min_p=0.05)}[tag]
path = shipped_model_dir(model)
llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=256, seed=0)
vocab = json.load(open(path + "/config.json"))["vocab_size"]
prompts, lens = random_token_prompts(256, 562, 562, 0.82, vocab, 0)
params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **sampling) for n in lens]
reqs = [{"prompt_token_ids": p} for p in prompts]
llm.generate(reqs[:2], params[:2], use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(reqs, params, use_tqdm=False)
dt = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
assert n == sum(lens), (n, sum(lens))
print(json.dumps({"model": model, "tag": tag, "out_tok_s": round(n / dt, 1)}))
'
run() {  # run TREE LABEL CMD...
  local tree=$1 label=$2; shift 2
  (cd "$tree" && PYTHONPATH="$tree:/tmp/site" timeout 300 "$@" 2>&1) \
    | grep -E '^\{|decode:|Error|Traceback' | sed "s/^/$label /"
}
for step in $STEPS; do
  IFS=: read -r kind model tag <<< "$step"
  for side in old new; do
    tree=$OLD; [ "$side" = new ] && tree=$NEW
    if [ "$kind" = lat ]; then
      run "$tree" "$side $model" python3 -m tokenmill.benchmarks.latency --model "$model" --batch-size 1 \
        --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048
    else
      run "$tree" "$side $model $tag" python3 -c "$NANO" "$model" "$tag"
    fi
  done
done
