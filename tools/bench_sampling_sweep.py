"""The nano-vllm workload under the seeds' sampling settings, on one engine (issue 25's "sampling at no cost").

Usage: python3 tools/bench_sampling_sweep.py MODEL [OUT_DIR]
  MODEL: a shipped shape (llama-3-8b, qwen3-0.6b: dummy weights) or a model directory.
Runs 256 requests with input and output lengths uniform in 101..1022 (seed 0, the `tokenmill bench throughput`
prompts of tools/gpu_bench.sh) once per setting, greedy first and last, on one LLM (CUDA graphs, prefix caching
off), and prints out tok/s per setting with its ratio to the mean of the two greedy runs. The settings are
greedy; temperature 0.6 / top_p 0.95; temperature 0.7 / top_k 20 / top_p 0.8; min_p 0.05 (temperature 1);
Qwen3's generation_config (temperature 0.6 / top_k 20 / top_p 0.95). NUM_PROMPTS overrides 256. Writes OUT_DIR/sampling_sweep_<name>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

SETTINGS = [
    ("greedy", dict(temperature=0.0)),
    ("t0.6/p0.95", dict(temperature=0.6, top_p=0.95)),
    ("t0.7/k20/p0.8", dict(temperature=0.7, top_k=20, top_p=0.8)),
    ("min_p 0.05", dict(temperature=1.0, min_p=0.05)),
    ("t0.6/k20/p0.95", dict(temperature=0.6, top_k=20, top_p=0.95)),
    ("greedy (again)", dict(temperature=0.0)),
]


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tokenmill import LLM, SamplingParams
    from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir
    name = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "/tmp/out")
    model = shipped_model_dir(name) or name
    llm = LLM(model=model, load_format="dummy" if shipped_model_dir(name) else "auto", skip_tokenizer_init=True,
              max_model_len=2048, max_num_seqs=256, enable_prefix_caching=False, seed=0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    num = int(os.environ.get("NUM_PROMPTS", "256"))
    prompts, out_lens = random_token_prompts(num, 562, 562, 0.82, vocab, 0)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    results = []
    for label, kw in SETTINGS:
        params = [SamplingParams(**kw, seed=i, max_tokens=n, ignore_eos=True, detokenize=False)
                  for i, n in enumerate(out_lens)]
        llm.generate(reqs[:2], params[:2], use_tqdm=False)  # warm-up (compiles this setting's kernels)
        start = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != sum(out_lens):
            raise RuntimeError(f"{label}: expected {sum(out_lens)} output tokens, got {produced}")
        results.append({"setting": label, **kw, "elapsed_s": elapsed, "output_tokens": produced,
                        "output_tok_s": produced / elapsed})
        print(f"{name} {label:16s} {produced / elapsed:10.1f} out tok/s", flush=True)
    greedy = (results[0]["output_tok_s"] + results[-1]["output_tok_s"]) / 2
    for r in results:
        r["vs_greedy"] = r["output_tok_s"] / greedy
        print(f"{name} {r['setting']:16s} {r['vs_greedy']:.3f} of greedy", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"sampling_sweep_{os.path.basename(name.rstrip('/'))}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
